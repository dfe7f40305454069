"""Vertex AI predict and health in process: default-shape routes, AIP_* routes from settings, errors."""

from __future__ import annotations

import pytest

from helpers.tensor_app import affine_model, client, tensor_app, text_model


async def test_default_routes_and_deployed_model_id():
    app = tensor_app({"affine": affine_model()}, vertex_deployed_model_id="42")
    async with client(app) as http:
        r = await http.post(
            "/v1/endpoints/e/deployedModels/d:predict", json={"instances": [[1, 2, 3, 4], [5, 6, 7, 8]]}
        )
        assert r.status_code == 200
        assert r.json() == {
            "predictions": [{"y": [1.5, 14.75], "best": 1}, {"y": [9.5, 28.75], "best": 1}],
            "deployedModelId": "42",
        }
        health = await http.get("/v1/endpoints/e/deployedModels/d")
        assert health.status_code == 200 and health.json() == {}


async def test_routes_from_settings_and_parameters_reach_the_model():
    model = text_model()
    app = tensor_app({"text": model}, vertex_predict_route="/predict", vertex_health_route="/health")
    async with client(app) as http:
        r = await http.post("/predict", json={"instances": ["ab", {"prompt": "c"}], "parameters": {"temperature": 0}})
        assert r.json() == {
            "predictions": [{"upper": "AB", "length": 2}, {"upper": "C", "length": 1}],
            "deployedModelId": "",
        }
        assert model.seen[-1].parameters == {"temperature": 0}
        assert (await http.get("/health")).status_code == 200


async def test_health_while_loading():
    app = tensor_app({"affine": affine_model()}, pending=("affine",), vertex_health_route="/health")
    async with client(app) as http:
        r = await http.get("/health")
        assert r.status_code == 503 and r.json() == {"error": "Model is not ready."}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{", 400, "JSON deserialization failed for the request data"),
        (b"[]", 400, "must be a JSON object"),
        (b'{"instances": []}', 400, "'instances' must be a non-empty list"),
        (b'{"instances": [[1]], "parameters": 1}', 400, "'parameters' must be a JSON object"),
        (b'{"instances": [[1, 2]]}', 400, "unexpected shape for input 'x'"),
        (b'{"instances": [[1, 2, 3, [4]]]}', 400, "Encountered list at unexpected level"),
    ],
)
async def test_errors(body, status, message):
    app = tensor_app({"affine": affine_model()})
    async with client(app) as http:
        r = await http.post("/v1/endpoints/e/deployedModels/d:predict", content=body)
    assert r.status_code == status and message in r.json()["error"]


async def test_model_name_query_picks_a_model_on_a_multi_model_server():
    app = tensor_app({"affine": affine_model(), "text": text_model()})
    async with client(app) as http:
        r = await http.post("/v1/endpoints/e/deployedModels/d:predict", json={"instances": ["x"]})
        assert r.status_code == 400 and r.json() == {"error": "Parameter model_name is required."}
        r = await http.post("/v1/endpoints/e/deployedModels/d:predict?model_name=text", json={"instances": ["x"]})
        assert r.json()["predictions"] == [{"upper": "X", "length": 1}]
