"""TF Serving REST over HTTP, in process: predict (row/columnar), classify, regress, status, metadata,
errors (4-space pretty `{"error": msg}` with TF Serving's status codes), CORS preflight."""

from __future__ import annotations

import json

import pytest

from helpers.tensor_app import affine_model, classifier_model, client, tensor_app, text_model


@pytest.fixture
def app():
    return tensor_app(
        {"affine": affine_model(), "text": text_model(), "cls": classifier_model(), "loading": affine_model()},
        pending=("loading",),
    )


async def test_predict_row_and_columnar_bytes(app):
    async with client(app) as http:
        r = await http.post("/v1/models/affine:predict", content=b'{"instances": [[1, 2, 3, 4], [5, 6, 7, 8]]}')
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.text == (
            '{\n    "predictions": [{\n        "y": [1.5, 14.75],\n        "best": 1\n    }, {\n'
            '        "y": [9.5, 28.75],\n        "best": 1\n    }\n    ]\n}'
        )
        r = await http.post("/v1/models/affine/versions/1:predict", content=b'{"inputs": [[1, 2, 3, NaN]]}')
        assert r.text == '{\n    "outputs": {\n        "y": [[NaN, NaN]],\n        "best": [0]\n    }\n}'


async def test_predict_strings_and_b64(app):
    async with client(app) as http:
        r = await http.post("/v1/models/text:predict", json={"inputs": {"text": ["hé", {"b64": "eHl6"}]}})
    assert r.status_code == 200
    assert json.loads(r.text) == {"outputs": {"upper": ["HÉ", "XYZ"], "length": [2, 3]}}


async def test_classify(app):
    async with client(app) as http:
        r = await http.post("/v1/models/cls:classify", json={"examples": [{"text": "good film"}, {"text": "bad"}]})
        assert r.status_code == 200
        assert r.json() == {
            "results": [[["negative", 0.25], ["positive", 0.75]], [["negative", 0.75], ["positive", 0.25]]]
        }
        r = await http.post("/v1/models/cls:regress", json={"examples": [{"text": "x"}]})
        assert r.status_code == 400
        assert r.json() == {
            "error": "Expected regression signature method_name to be tensorflow/serving/regress. Was: tensorflow/serving/classify"
        }


async def test_status_and_metadata(app):
    async with client(app) as http:
        r = await http.get("/v1/models/affine")
        assert r.text == (
            '{\n "model_version_status": [\n  {\n   "version": "1",\n   "state": "AVAILABLE",\n'
            '   "status": {\n    "error_code": "OK",\n    "error_message": ""\n   }\n  }\n ]\n}'
        )
        assert (await http.get("/v1/models/loading")).json()["model_version_status"][0]["state"] == "LOADING"
        assert (await http.get("/v1/models/affine/versions/1")).status_code == 200
        meta = (await http.get("/v1/models/affine/metadata")).json()
        assert meta["model_spec"] == {"name": "affine", "signature_name": "", "version": "1"}
        sig = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
        assert sig["method_name"] == "tensorflow/serving/predict"
        assert sig["inputs"]["x"] == {
            "dtype": "DT_FLOAT",
            "tensor_shape": {"dim": [{"size": "-1", "name": ""}, {"size": "4", "name": ""}], "unknown_rank": False},
            "name": "x:0",
        }
        assert sig["outputs"]["best"]["dtype"] == "DT_INT64"
        cls = (await http.get("/v1/models/cls/metadata")).json()
        assert (
            cls["metadata"]["signature_def"]["signature_def"]["serving_default"]["method_name"]
            == "tensorflow/serving/classify"
        )


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("POST", "/v1/models/nope:predict", b'{"instances": [1]}', 404, "Servable not found for request: Latest(nope)"),
        (
            "POST",
            "/v1/models/nope/versions/3:predict",
            b'{"instances": [1]}',
            404,
            "Servable not found for request: Specific(nope, 3)",
        ),
        (
            "POST",
            "/v1/models/affine/versions/3:predict",
            b'{"instances": [1]}',
            404,
            "Servable not found for request: Specific(affine, 3)",
        ),
        (
            "POST",
            "/v1/models/affine/labels/canary:predict",
            b'{"instances": [1]}',
            400,
            "Unrecognized servable version label: canary",
        ),
        ("GET", "/v1/models/nope", b"", 404, "Could not find any versions of model nope"),
        ("GET", "/v1/models/affine/versions/9", b"", 404, "Could not find version 9 of model affine"),
        ("GET", "/v1/models/", b"", 400, "Missing model name in request."),
        ("POST", "/v1/models/affine:explain", b"{}", 400, "Malformed request: POST /v1/models/affine:explain"),
        ("POST", "/v1/models/affine:predict", b"", 400, "JSON Parse error: The document is empty"),
        ("POST", "/v1/models/affine:predict", b"nonsense", 400, "JSON Parse error: Invalid value. at offset: 0"),
        (
            "POST",
            "/v1/models/affine:predict",
            b'{"instances": [[1, 2, 3, 4]], "signature_name": "x"}',
            400,
            'Serving signature name: "x" not found in signature def',
        ),
        ("POST", "/v1/models/loading:predict", b'{"instances": [1]}', 503, "Model loading is loading"),
        (
            "POST",
            "/v1/models/affine:predict",
            b'{"instances": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
            400,
            "JSON Parse error: The document is nested too deeply. at offset: 0",
        ),
    ],
)
async def test_errors(app, method, path, body, status, message):
    async with client(app) as http:
        r = await http.request(method, path, content=body)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.text.startswith('{\n    "error": ')
    if message is not None:
        assert r.json() == {"error": message}


async def test_deeply_nested_ignored_key_is_skipped(app):
    body = (
        b'{"ignored": '
        + b"[" * 200_000
        + b'"]", {"x": 1}'
        + b"]" * 200_000
        + b', "instances": [[1, 2, 3, 4]], "z": -Inf}'
    )
    async with client(app) as http:
        r = await http.post("/v1/models/affine:predict", content=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"predictions": [{"y": [1.5, 14.75], "best": 1}]}


async def test_percent_encoded_model_name(app):
    async with client(app) as http:
        r = await http.post("/v1/models/no%2Fsuch:predict", content=b'{"instances": [1]}')
    assert r.json() == {"error": "Servable not found for request: Latest(no/such)"}


async def test_cors_preflight(app):
    async with client(app) as http:
        ok = await http.options("/v1/models/affine:predict", headers={"Origin": "https://example.test"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-methods"] == "POST, GET"
        bad = await http.options("/v1/models/affine:predict")
        assert bad.status_code == 400 and bad.json() == {"error": "Origin header is missing in CORS preflight"}


async def test_regress_on_a_regression_model():
    import numpy as np

    from helpers.tensor_app import NumpyModel
    from lmiserve.core.tensors import ModelSignature, TensorSpec

    signature = ModelSignature(
        inputs=(TensorSpec("text", "BYTES", (-1,)),), outputs=(TensorSpec("score", "FP32", (-1,)),)
    )
    model = NumpyModel(
        "regression", signature, lambda text: {"score": np.array([len(t) / 4 for t in text], dtype=np.float32)}
    )
    async with client(tensor_app({"reg": model})) as http:
        r = await http.post(
            "/v1/models/reg:regress", json={"examples": [{"text": "ab"}, {"text": {"b64": "YWJjZA=="}}]}
        )
        assert r.status_code == 200 and r.json() == {"results": [0.5, 1.0]}
        r = await http.post("/v1/models/reg:classify", json={"examples": [{"text": "ab"}]})
        assert r.status_code == 400
        assert r.json() == {
            "error": "Expected classification signature method_name to be tensorflow/serving/classify. Was: tensorflow/serving/regress"
        }
        meta = (await http.get("/v1/models/reg/metadata")).json()
        assert (
            meta["metadata"]["signature_def"]["signature_def"]["serving_default"]["method_name"]
            == "tensorflow/serving/regress"
        )


async def test_v1_models_itself(app):
    """`GET /v1/models` is the OpenAI list when that route exists (it comes first); other methods are TF Serving's."""
    async with client(app) as http:
        r = await http.post("/v1/models", content=b"{}")
    assert r.status_code == 400 and r.json() == {"error": "Malformed request: POST /v1/models"}
