"""`lmiserve serve --model-store DIR` with the tiny LLM, a tiny classifier, MiniLM and a TorchScript
module in one real server: /ping, the management API (list, describe, register, unregister) and
inference by model name on the LMI routes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.server import run_server
from helpers.tensor_models import CLASSIFIER_LABELS, affine_reference, build_torchscript_dir

MODELS = ["affine", "classifier", "minilm", "tiny-llm"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir, tiny_classifier_dir, minilm_dir) -> Path:
    root = tmp_path_factory.mktemp("store")
    shutil.copytree(tiny_model_dir, root / "tiny-llm")
    (root / "tiny-llm" / "serving.properties").write_text("option.max_new_tokens=5\n")
    shutil.copytree(tiny_classifier_dir, root / "classifier")
    (root / "classifier" / "serving.properties").write_text("option.batch_size=4\noption.max_batch_delay=20\n")
    (root / "minilm").mkdir()
    (root / "minilm" / "serving.properties").write_text(f"option.model_id={minilm_dir}\noption.batch_size=8\n")
    build_torchscript_dir(root / "affine")
    (root / "notes").mkdir()  # neither properties nor weights: not a model
    (root / "notes" / "README.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def client(store, tmp_path_factory):
    # registration may load from the store and from pytest's temporary directories (the other fixtures')
    allowed = f"allowed_model_paths={tmp_path_factory.getbasetemp()}"
    with run_server(["--model-store", str(store), "-o", "max_batch_delay=10", "-o", allowed]) as url:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            yield client


def post(client, path, payload, **kwargs):
    return client.post(path, content=json.dumps(payload), headers={"content-type": "application/json"}, **kwargs)


def test_ping_reports_every_model(client):
    response = client.get("/ping")
    assert response.status_code == 200
    assert response.json() == {name: {"status": "Healthy"} for name in MODELS}
    assert response.text.startswith("{\n  ")


def test_list_and_describe(client, store, minilm_dir):
    body = client.get("/models").json()
    assert [m["modelName"] for m in body["models"]] == MODELS
    assert {m["status"] for m in body["models"]} == {"READY"}
    urls = {m["modelName"]: m["modelUrl"] for m in body["models"]}
    assert urls["minilm"] == f"file:{minilm_dir.resolve()}"
    assert urls["classifier"] == f"file:{(store / 'classifier').resolve()}"
    described = client.get("/models/classifier").json()[0]["models"][0]
    assert (described["modelName"], described["batchSize"], described["maxBatchDelayMillis"]) == ("classifier", 4, 20)
    assert client.get("/models/tiny-llm").json()[0]["models"][0]["batchSize"] == 32


def test_name_less_generation_goes_to_the_llm(client):
    response = post(client, "/invocations", {"inputs": "Hello"})
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["generated_text"], str)
    named = post(client, "/predictions/tiny-llm", {"inputs": "Hello"})
    assert named.json() == response.json()  # greedy: same text


def test_embeddings_by_name(client):
    response = post(
        client, "/predictions/minilm", {"inputs": ["A man plays a guitar.", "Someone plays guitar.", "Stocks fell."]}
    )
    assert response.status_code == 200, response.text
    emb = np.array(response.json())
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]
    single = post(client, "/models/minilm/invoke", {"inputs": "A man plays a guitar."}).json()
    np.testing.assert_allclose(single[0], emb[0], atol=1e-5)


def test_classifier_by_name(client):
    response = post(client, "/invocations?model_name=classifier", {"inputs": ["good movie", "bad food"]})
    assert response.status_code == 200, response.text
    rows = response.json()
    assert len(rows) == 2 and all(set(r) == {"label", "score"} for r in rows)
    assert all(r["label"] in CLASSIFIER_LABELS and 1 / 3 <= r["score"] <= 1 for r in rows)
    text_plain = client.post("/predictions/classifier", content="good movie", headers={"content-type": "text/plain"})
    assert text_plain.json()[0]["label"] == rows[0]["label"]
    assert text_plain.json()[0]["score"] == pytest.approx(rows[0]["score"], abs=1e-5)  # padding: float noise only


def test_torchscript_by_name(client):
    x = [[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0]]
    response = post(client, "/predictions/affine", {"inputs": x})
    assert response.status_code == 200, response.text
    y, best = affine_reference(np.array(x))
    body = response.json()
    np.testing.assert_allclose(body["y"], y, rtol=1e-6)
    assert body["best"] == best.tolist()
    assert post(client, "/predictions/affine", {"inputs": {"x": x}}).json() == body


@pytest.mark.parametrize(
    "path, payload, message",
    [
        ("/predictions/affine", {"inputs": [[1, 2, 3]]}, "must have shape [-1, 4], got [1, 3]"),
        ("/predictions/affine", {"inputs": [[1, 2, 3, 4], [1]]}, "ragged"),
        ("/predictions/affine", {"inputs": {"z": [[1, 2, 3, 4]]}}, "unknown input 'z'"),
        ("/predictions/minilm", {"inputs": [1, 2]}, "list of non-empty strings"),
        ("/predictions/classifier", {"text": "x"}, "'inputs' field"),
    ],
)
def test_bad_tensor_payloads_are_424(client, path, payload, message):
    response = post(client, path, payload)
    assert response.status_code == 424, response.text
    body = response.json()
    assert body["code"] == 424 and message in body["error"]


def test_unknown_model_is_404(client):
    response = post(client, "/predictions/nope", {"inputs": "x"})
    assert response.status_code == 404
    assert response.json() == {
        "code": 404,
        "type": "ModelNotFoundException",
        "message": "Model or workflow not found: nope",
    }


def test_register_invoke_and_unregister(client, tiny_regressor_dir):
    response = client.post(
        "/models", params={"url": f"file:{tiny_regressor_dir}", "model_name": "reg", "batch_size": "2"}
    )
    assert response.status_code == 200, response.text
    assert response.text == '{\n  "status": "Model \\"reg\\" registered."\n}\n'
    assert "reg" in [m["modelName"] for m in client.get("/models").json()["models"]]
    described = client.get("/models/reg").json()[0]["models"][0]
    assert (described["batchSize"], described["loadedAtStartup"], described["status"]) == (2, False, "Healthy")
    scores = post(client, "/predictions/reg", {"inputs": ["good", "bad"]}).json()
    assert len(scores) == 2 and all(isinstance(s["score"], float) for s in scores)
    conflict = client.post("/models", params={"url": str(tiny_regressor_dir), "model_name": "reg"})
    assert conflict.status_code == 409 and conflict.json()["type"] == "ConflictStatusException"
    deleted = client.delete("/models/reg")
    assert deleted.status_code == 200 and deleted.json() == {"status": 'Workflow "reg" unregistered'}
    assert post(client, "/predictions/reg", {"inputs": "good"}).status_code == 404
    again = client.delete("/models/reg")
    assert again.status_code == 404 and again.json()["message"] == "Model or workflow not found: reg"
    assert client.get("/ping").status_code == 200


def test_register_with_a_json_body_and_name_from_the_directory(client, tiny_classifier_dir, tmp_path):
    target = tmp_path / "sentiment"
    shutil.copytree(tiny_classifier_dir, target)
    response = post(client, "/models", {"url": str(target)})
    assert response.status_code == 200, response.text
    assert post(client, "/predictions/sentiment", {"inputs": "ok"}).status_code == 200
    assert client.delete("/models/sentiment").status_code == 200


@pytest.mark.parametrize(
    "params, status, kind, message",
    [
        ({}, 400, "BadRequestException", "Parameter url is required."),
        ({"url": "no-such-model"}, 400, "BadRequestException", "Model directory not found: no-such-model"),
        ({"url": "https://example.com/m.tar.gz"}, 400, "BadRequestException", "local directories"),
        ({"url": "/does/not/exist"}, 403, "ForbiddenException", "not under an allowed model root"),
        ({"url": "/usr/lib"}, 403, "ForbiddenException", "not under an allowed model root"),
        ({"url": "file:/etc"}, 403, "ForbiddenException", "not under an allowed model root"),
        ({"url": "../../../../../../../../etc"}, 403, "ForbiddenException", "not under an allowed model root"),
        ({"url": "\x00"}, 400, "BadRequestException", "Invalid url"),
        ({"url": ".", "model_name": "root"}, 400, "BadRequestException", "No model in .: no weights"),
    ],
)
def test_registration_errors(client, params, status, kind, message):
    response = client.post("/models", params=params)
    assert response.status_code == status
    body = response.json()
    assert body["type"] == kind and message in body["message"]


def test_registration_resolves_symlinks_before_the_root_check(client, store):
    (store / "escape").symlink_to("/usr/lib", target_is_directory=True)
    try:
        response = client.post("/models", params={"url": "escape", "model_name": "escape"})
        assert (response.status_code, response.json()["type"]) == (403, "ForbiddenException")
    finally:
        (store / "escape").unlink()


def test_a_relative_url_is_taken_from_the_model_store(client, store, tiny_classifier_dir):
    shutil.copytree(tiny_classifier_dir, store / "later")
    try:
        response = client.post("/models", params={"url": "later"})
        assert response.status_code == 200, response.text
        assert post(client, "/predictions/later", {"inputs": "ok"}).status_code == 200
        assert client.delete("/models/later").status_code == 200
    finally:
        shutil.rmtree(store / "later")


def test_failed_async_registration_shows_in_ping_until_deleted(client, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.pt").write_bytes(b"not torchscript")
    response = client.post("/models", params={"url": str(broken), "synchronous": "false"})
    assert response.status_code == 202
    assert response.json() == {"status": 'Model "broken" registration scheduled.'}
    for _ in range(100):
        status = {m["modelName"]: m["status"] for m in client.get("/models").json()["models"]}["broken"]
        if status != "PENDING":
            break
        import time

        time.sleep(0.1)
    assert status == "FAILED"
    ping = client.get("/ping")
    assert ping.status_code == 503 and ping.json()["broken"] == {"status": "Unhealthy"}
    assert client.delete("/models/broken").status_code == 200
    assert client.get("/ping").status_code == 200


def test_synchronous_registration_failure_is_500_and_not_kept(client, tmp_path):
    broken = tmp_path / "broken-sync"
    broken.mkdir()
    (broken / "model.pt").write_bytes(b"not torchscript")
    response = client.post("/models", params={"url": str(broken)})
    assert response.status_code == 500
    assert "could not load the TorchScript module" in response.json()["message"]
    assert "broken-sync" not in [m["modelName"] for m in client.get("/models").json()["models"]]


def test_register_a_torchscript_file_by_its_path(client, tmp_path):
    directory = build_torchscript_dir(tmp_path / "scripted")
    clash = client.post("/models", params={"url": f"file:{directory / 'affine.pt'}"})  # named after the file
    assert clash.status_code == 409 and clash.json()["message"] == "Model affine is already registered."
    response = client.post("/models", params={"url": f"file:{directory / 'affine.pt'}", "model_name": "scripted"})
    assert response.status_code == 200, response.text
    body = post(client, "/predictions/scripted", {"inputs": [[0, 0, 0, 1]]}).json()
    assert body == {"y": [[-0.5, 2.75]], "best": [1]}
    assert client.delete("/models/scripted").status_code == 200


def test_list_models_pages(client):
    first = client.get("/models", params={"limit": 3}).json()
    assert first["nextPageToken"] == "3" and [m["modelName"] for m in first["models"]] == MODELS[:3]
    rest = client.get("/models", params={"limit": 3, "next_page_token": first["nextPageToken"]}).json()
    assert list(rest) == ["models"] and [m["modelName"] for m in rest["models"]] == MODELS[3:]
    bad = client.get("/models", params={"limit": "x"})
    assert bad.status_code == 400 and bad.json()["message"] == "Parameter limit must be an integer: x"
