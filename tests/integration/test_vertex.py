"""Vertex AI contract on a real server: AIP_PREDICT_ROUTE / AIP_HEALTH_ROUTE / AIP_DEPLOYED_MODEL_ID
from the environment, the LLM answering instances with generated text, parameters, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from helpers.server import run_server

TIMEOUT = 60
ENV = {
    "AIP_PREDICT_ROUTE": "/vertex/predict",
    "AIP_HEALTH_ROUTE": "/vertex/health",
    "AIP_DEPLOYED_MODEL_ID": "8675309",
    "AIP_MODE": "PREDICTION",
}


@pytest.fixture(scope="module")
def vertex_url(tiny_model_dir: Path) -> Iterator[str]:
    with run_server(["--model-id", str(tiny_model_dir), "-o", "model_name=tiny"], env=ENV) as url:
        yield url


def test_predict_route_from_environment(vertex_url):
    lmi = requests.post(
        f"{vertex_url}/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}}, timeout=TIMEOUT
    ).json()
    r = requests.post(
        f"{vertex_url}/vertex/predict",
        json={"instances": ["Hello", {"prompt": "Hello"}], "parameters": {"max_new_tokens": 5}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200
    assert r.json() == {"predictions": [lmi["generated_text"]] * 2, "deployedModelId": "8675309"}


def test_health_route_from_environment(vertex_url):
    r = requests.get(f"{vertex_url}/vertex/health", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {}


def test_default_shape_routes_and_errors(vertex_url):
    r = requests.post(
        f"{vertex_url}/v1/endpoints/1/deployedModels/2:predict",
        json={"instances": ["Hi"], "parameters": {"max_new_tokens": 2}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200 and len(r.json()["predictions"]) == 1
    r = requests.post(f"{vertex_url}/vertex/predict", json={"instances": [1]}, timeout=TIMEOUT)
    assert r.status_code == 400 and "is not of expected type: string" in r.json()["error"]
    r = requests.post(f"{vertex_url}/vertex/predict", data=b"nope", timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"].startswith("JSON deserialization failed for the request data")
