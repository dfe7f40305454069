"""The issue's done-when test: one `lmiserve serve --model-store DIR` holding the bundled LLM (SmolLM2)
and all-MiniLM-L6-v2 answers a V2 embedding request from tritonclient, a TF Serving :predict for both
models, a SageMaker JSON Lines batch and a Vertex AI request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from helpers.server import run_server

pytestmark = pytest.mark.e2e
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def store_url(smollm_dir: Path, minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = tmp_path_factory.mktemp("store")
    (store / "smollm").mkdir()
    (store / "smollm" / "serving.properties").write_text("option.max_new_tokens=16\n")  # no model_id: the bundled LLM
    (store / "minilm").mkdir()
    (store / "minilm" / "serving.properties").write_text(f"option.model_id={minilm_dir}\n")
    env = {
        "AIP_PREDICT_ROUTE": "/vertex/predict",
        "AIP_HEALTH_ROUTE": "/vertex/health",
        "AIP_DEPLOYED_MODEL_ID": "store-1",
    }
    with run_server(["--model-store", str(store)], env=env, timeout=300) as url:
        yield url


def lmi(url: str, prompt: str, **parameters) -> str:
    r = httpx.post(
        f"{url}/invocations",
        params={"model_name": "smollm"},
        json={"inputs": prompt, "parameters": parameters},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def test_v2_embeddings_from_tritonclient(store_url):
    client = triton.InferenceServerClient(store_url.removeprefix("http://"), network_timeout=TIMEOUT)
    assert client.is_server_ready() and client.is_model_ready("minilm") and client.is_model_ready("smollm")
    texts = np.array(
        ["The cat sat on the mat.", "A kitten lay on the rug.", "Interest rates rose again."], dtype=object
    )
    inp = triton.InferInput("text", [3], "BYTES")
    inp.set_data_from_numpy(texts)
    emb = client.infer("minilm", [inp]).as_numpy("embedding")
    assert emb.shape == (3, 384)
    assert float(emb[0] @ emb[1]) > float(emb[0] @ emb[2]) + 0.3


def test_tf_serving_predict_for_both_models(store_url):
    r = httpx.post(f"{store_url}/v1/models/minilm:predict", json={"instances": ["hello world"]}, timeout=TIMEOUT)
    assert r.status_code == 200 and len(r.json()["predictions"][0]) == 384
    prompt = "The capital of France is"
    r = httpx.post(
        f"{store_url}/v1/models/smollm:predict",
        json={"instances": [prompt], "parameters": {"max_new_tokens": 8}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    assert r.json() == {"predictions": [lmi(store_url, prompt, max_new_tokens=8)]}
    assert "Paris" in r.json()["predictions"][0]


def test_sagemaker_json_lines_batch(store_url):
    lines = [
        {"inputs": "What is 2 + 2?", "parameters": {"max_new_tokens": 12}},
        {"inputs": "Name a color.", "parameters": {"max_new_tokens": 6}},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    r = httpx.post(
        f"{store_url}/invocations",
        content=body.encode(),
        timeout=TIMEOUT,
        headers={
            "content-type": "application/jsonlines",
            "X-Amzn-SageMaker-Custom-Attributes": "tfs-model-name=smollm",
        },
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/jsonlines"
    out = [json.loads(line)["generated_text"] for line in r.text.splitlines()]
    assert out == [lmi(store_url, line["inputs"], **line["parameters"]) for line in lines]
    r = httpx.post(
        f"{store_url}/invocations",
        content=b'"first text"\n"second text"\n',
        timeout=TIMEOUT,
        headers={
            "content-type": "application/jsonlines",
            "X-Amzn-SageMaker-Custom-Attributes": "tfs-model-name=minilm",
        },
    )
    assert [len(json.loads(line)["embedding"]) for line in r.text.splitlines()] == [384, 384]


def test_vertex_request(store_url):
    assert httpx.get(f"{store_url}/vertex/health", timeout=TIMEOUT).status_code == 200
    prompt = "Write one word:"
    r = httpx.post(
        f"{store_url}/vertex/predict",
        json={"instances": [prompt], "parameters": {"max_new_tokens": 5}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    assert r.json() == {"predictions": [lmi(store_url, prompt, max_new_tokens=5)], "deployedModelId": "store-1"}
