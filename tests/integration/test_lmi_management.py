"""Health, management and front-end errors over real HTTP."""

from __future__ import annotations

import json

import pytest


def frontend_error(code: int, kind: str, message: str) -> str:
    """LMI's front-end error body: 2-space pretty JSON code/type/message and a final newline."""
    return f'{{\n  "code": {code},\n  "type": "{kind}",\n  "message": "{message}"\n}}\n'


def assert_frontend_error(response, code: int, kind: str, message: str) -> None:
    assert response.status_code == code, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.text == frontend_error(code, kind, message)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping(server, method):
    response = server.client.request(method, "/ping", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.text == f'{{\n  "{server.name}": {{\n    "status": "Healthy"\n  }}\n}}\n'


def test_model_name_is_the_directory_name(server):
    assert server.name == server.model_dir.name
    assert json.loads(server.get("/ping").text) == {server.name: {"status": "Healthy"}}


def test_list_models(server):
    response = server.get("/models")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.text.endswith("\n") and response.text.startswith("{\n  ")  # pretty-printed
    body = response.json()
    assert list(body) == ["models"]  # no nextPageToken: a single page
    model = body["models"][0]
    assert model["modelName"] == server.name
    assert model["status"] == "READY"
    assert model["modelUrl"].startswith("file:")
    assert None not in model.values()  # null fields are omitted


def test_describe_model(server):
    response = server.get(f"/models/{server.name}")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert isinstance(body, list) and len(body) == 1
    assert body[0]["workflowName"] == server.name
    model = body[0]["models"][0]
    assert model["modelName"] == server.name
    assert model["status"] == "Healthy"
    assert model["queueSize"] == 1000
    assert model["requestInQueue"] == 0
    assert model["batchSize"] == 32  # max_rolling_batch_size
    workers = model["workerGroups"][0]["workers"]
    assert isinstance(workers, list) and workers
    assert workers[0]["status"] == "READY"
    assert set(workers[0]) >= {"id", "startTime", "status"}
    assert set(model["workerGroups"][0]["device"]) == {"deviceType", "deviceId"}


def test_describe_unknown_model(server):
    assert_frontend_error(
        server.get("/models/nope"), 404, "ModelNotFoundException", "Model or workflow not found: nope"
    )


@pytest.mark.parametrize(
    "path", ["/predictions/nope", "/predictions/nope/1", "/models/nope/invoke", "/invocations?model_name=nope"]
)
def test_inference_on_unknown_model(server, path):
    response = server.post({"inputs": "Hello"}, path=path)
    assert_frontend_error(response, 404, "ModelNotFoundException", "Model or workflow not found: nope")


def test_unknown_model_name_header(server):
    response = server.post({"inputs": "Hello"}, headers={"model_name": "nope"})
    assert_frontend_error(response, 404, "ModelNotFoundException", "Model or workflow not found: nope")


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("path", ["/nope", "/v1/nothing", "/predictions"])
def test_unknown_path(server, method, path):
    response = server.client.request(method, path, timeout=10)
    assert_frontend_error(
        response, 404, "ResourceNotFoundException", "Requested resource is not found, please refer to API document."
    )
