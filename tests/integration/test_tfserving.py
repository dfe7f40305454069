"""TF Serving REST with plain `requests` against real servers: the LLM (prompts in, generated text out),
MiniLM embeddings, the TorchScript affine model, a tiny classifier (:classify), status and errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from helpers.server import run_server
from helpers.tensor_models import affine_reference
from lmiserve.protocols.tensor.codecs.tfjson import format_float

TIMEOUT = 60


@pytest.fixture(scope="module")
def classifier_url(tiny_classifier_dir: Path) -> Iterator[str]:
    with run_server(["--model-id", str(tiny_classifier_dir), "-o", "model_name=sentiment"]) as url:
        yield url


def test_llm_predict_row_and_columnar(server):
    expected = server.generate("Hello there", max_new_tokens=6)["generated_text"]
    r = requests.post(
        f"{server.url}/v1/models/{server.name}:predict",
        timeout=TIMEOUT,
        json={"instances": ["Hello there", {"b64": "SGVsbG8gdGhlcmU="}], "parameters": {"max_new_tokens": 6}},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"predictions": [expected, expected]}
    r = requests.post(
        f"{server.url}/v1/models/{server.name}/versions/1:predict",
        timeout=TIMEOUT,
        json={"inputs": ["Hello there"], "parameters": {"max_new_tokens": 6}},
    )
    assert r.json() == {"outputs": [expected]}


def test_llm_bad_parameters_are_400(server):
    r = requests.post(
        f"{server.url}/v1/models/{server.name}:predict",
        timeout=TIMEOUT,
        json={"instances": ["Hi"], "parameters": {"max_new_tokens": -1}},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_embeddings_predict(minilm_server):
    r = requests.post(
        f"{minilm_server.url}/v1/models/minilm:predict",
        json={"instances": ["a cat", "a dog", "tax law"]},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    emb = np.array(r.json()["predictions"])
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)


def test_affine_predict_float_formatting(affine_server):
    x = np.array([[1 / 3, 2, 3, 4]], dtype=np.float32)
    r = requests.post(
        f"{affine_server.url}/v1/models/affine:predict", data=b'{"instances": [[0.33333334, 2, 3, 4]]}', timeout=TIMEOUT
    )
    y, best = affine_reference(x)
    body = r.text
    assert body.startswith('{\n    "predictions": [{\n        "y": [') and body.endswith("    }\n    ]\n}")
    row = json.loads(body)["predictions"][0]
    assert row["best"] == int(best[0])
    np.testing.assert_allclose(np.array(row["y"], dtype=np.float32), y[0], rtol=1e-6)
    tokens = body.split('"y": [')[1].split("]")[0].split(", ")
    for token in tokens:  # each number is TF Serving's text of the float32 it denotes
        assert format_float(float(np.float32(token)), True) == token


def test_status_metadata_and_errors(affine_server):
    base = f"{affine_server.url}/v1/models"
    status = requests.get(f"{base}/affine", timeout=TIMEOUT).json()
    assert status == {
        "model_version_status": [
            {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        ]
    }
    meta = requests.get(f"{base}/affine/versions/1/metadata", timeout=TIMEOUT).json()
    assert meta["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["x"]["dtype"] == "DT_FLOAT"
    r = requests.post(f"{base}/affine:predict", data=b'{"instances": [[1, 2, 3]]}', timeout=TIMEOUT)
    assert r.status_code == 400 and r.text.startswith('{\n    "error": ')
    r = requests.post(f"{base}/other:predict", data=b'{"instances": [1]}', timeout=TIMEOUT)
    assert r.status_code == 404 and r.json() == {"error": "Servable not found for request: Latest(other)"}
    r = requests.get(f"{base}/", timeout=TIMEOUT)
    assert r.status_code == 400 and r.json() == {"error": "Missing model name in request."}


def test_classify_with_a_real_classifier(classifier_url):
    r = requests.post(
        f"{classifier_url}/v1/models/sentiment:classify",
        json={"examples": [{"text": "good movie"}, {"text": ["bad food"]}]},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2
    for pairs in results:
        assert [label for label, _ in pairs] == ["negative", "neutral", "positive"]
        assert sum(score for _, score in pairs) == pytest.approx(1.0, abs=1e-5)
    r = requests.post(
        f"{classifier_url}/v1/models/sentiment:predict", json={"instances": ["good movie"]}, timeout=TIMEOUT
    )
    row = r.json()["predictions"][0]
    assert row["label"] in ("negative", "neutral", "positive") and len(row["probabilities"]) == 3
