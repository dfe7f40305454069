"""KServe V2 over HTTP, in process, on numpy TensorModels: infer (JSON and binary), every datatype,
shape checks, requested outputs, id echo, parameters, MLServer content types, health, metadata, errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from helpers.tensor_app import affine_model, client, echo_model, tensor_app, text_model, two_input_model

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v2"
ALL = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
DATA = {"BOOL": [True, False], "FP16": [0.5, -2.0], "FP32": [0.25, -1.5], "FP64": [0.1, 1e300], "BYTES": ["ab", "ç"]}


@pytest.fixture
def app():
    models = {"affine": affine_model(), "text": text_model(), "two": two_input_model(), "loading": affine_model()}
    models.update({f"echo_{d.lower()}": echo_model(d) for d in ALL})
    return tensor_app(models, pending=("loading",))


def infer_body(name, datatype, shape, data, **extra):
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}], **extra}


@pytest.mark.parametrize("datatype", ALL)
async def test_every_datatype_json(app, datatype):
    data = DATA.get(datatype, [1, 2])
    async with client(app) as http:
        r = await http.post(f"/v2/models/echo_{datatype.lower()}/infer", json=infer_body("x", datatype, [1, 2], data))
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "y" and out["datatype"] == datatype and out["shape"] == [1, 2]
    assert out["data"] == data


@pytest.mark.parametrize("datatype", ALL)
async def test_every_datatype_binary(app, datatype):
    data = DATA.get(datatype, [1, 2])
    array = (
        np.array([d.encode() for d in data], dtype=object)
        if datatype == "BYTES"
        else np.array(data, dtype=_dtype(datatype))
    )
    raw = _raw(array)
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": datatype, "shape": [2, 1], "parameters": {"binary_data_size": len(raw)}}
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    async with client(app) as http:
        r = await http.post(
            f"/v2/models/echo_{datatype.lower()}/infer",
            content=header + raw,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    size = int(r.headers["inference-header-content-length"])
    doc = json.loads(r.content[:size])
    out = doc["outputs"][0]
    assert out["shape"] == [2, 1] and "data" not in out
    assert out["parameters"]["binary_data_size"] == len(raw)
    assert r.content[size:] == raw


def _dtype(datatype):
    return {"BOOL": np.bool_, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}.get(datatype) or np.dtype(
        datatype.lower()
    )


def _raw(array):
    if array.dtype == object:
        return b"".join(struct.pack("<I", len(v)) + v for v in array)
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


async def test_affine_json_with_id_outputs_and_parameters(app):
    body = infer_body(
        "x",
        "FP32",
        [2, 4],
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        id="req-7",
        outputs=[{"name": "best"}, {"name": "y"}],
        parameters={"custom": 1},
    )
    async with client(app) as http:
        r = await http.post("/v2/models/affine/infer", json=body)
    assert r.status_code == 200
    doc = r.json()
    assert doc["id"] == "req-7" and doc["model_name"] == "affine" and doc["model_version"] == "1"
    assert [o["name"] for o in doc["outputs"]] == ["best", "y"]
    assert doc["outputs"][0] == {"name": "best", "datatype": "INT64", "shape": [2], "data": [1, 1]}
    assert doc["outputs"][1]["data"] == [1.5, 14.75, 9.5, 28.75]


async def test_binary_response_golden(app):
    """binary_data_output for all outputs: the exact bytes (JSON header + segments)."""
    body = infer_body("x", "FP32", [1, 4], [1, 2, 3, 4], parameters={"binary_data_output": True})
    async with client(app) as http:
        r = await http.post("/v2/models/affine/infer", json=body)
    assert r.status_code == 200
    assert r.headers["inference-header-content-length"] == str(r.content.index(b"}]}") + 3)
    assert r.content == (GOLDEN / "affine_binary.bin").read_bytes()


async def test_per_output_binary_overrides_request_default(app):
    body = infer_body(
        "x",
        "FP32",
        [1, 4],
        [1, 2, 3, 4],
        parameters={"binary_data_output": True},
        outputs=[{"name": "y", "parameters": {"binary_data": False}}, {"name": "best"}],
    )
    async with client(app) as http:
        r = await http.post("/v2/models/affine/infer", json=body)
    size = int(r.headers["inference-header-content-length"])
    doc = json.loads(r.content[:size])
    assert doc["outputs"][0]["data"] == [1.5, 14.75]
    assert np.frombuffer(r.content[size:], dtype="<i8").tolist() == [1]


async def test_binary_header_without_octet_content_type_and_mixed_inputs(app):
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float64).tobytes()
    header = json.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP64", "shape": [2, 2], "parameters": {"binary_data_size": len(a)}},
                {"name": "b", "datatype": "INT32", "shape": [2], "data": [10, 20]},
            ]
        }
    ).encode()
    async with client(app) as http:
        r = await http.post(
            "/v2/models/two/infer",
            content=header + a,
            headers={"Inference-Header-Content-Length": str(len(header)), "content-type": "application/json"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [13.0, 27.0]


async def test_n_by_1_input_and_names_free_only_under_a_request_codec(app):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["a", "b"]}]}
    async with client(app) as http:
        r = await http.post("/v2/models/text/infer", json=body)
        assert r.status_code == 200
        assert r.json()["outputs"][0]["data"] == ["A", "B"]
        body["inputs"][0]["name"] = "input-1"
        r = await http.post("/v2/models/text/infer", json=body)
        assert r.status_code == 400
        assert r.json() == {"error": "unexpected inference input 'input-1' for model 'text'"}
        r = await http.post("/v2/models/text/infer", json={**body, "parameters": {"content_type": "str"}})
        assert r.status_code == 200  # MLServer's StringRequestCodec: the request is one value, whatever its name
        assert r.json()["outputs"][0]["data"] == ["A", "B"]


async def test_mlserver_content_types(app):
    async with client(app) as http:
        b64 = {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": ["aGVsbG8="],
                    "parameters": {"content_type": "base64"},
                }
            ]
        }
        r = await http.post("/v2/models/text/infer", json=b64)
        assert r.json()["outputs"][0]["data"] == ["HELLO"]
        assert r.json()["outputs"][0]["parameters"] == {"content_type": "str"}
        when = {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": ["2022-01-11T11:00:00"],
                    "parameters": {"content_type": "datetime"},
                }
            ]
        }
        r = await http.post("/v2/models/text/infer", json=when)
        assert r.json()["outputs"][0]["data"] == ["2022-01-11T11:00:00"]
        bad = {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "data": ["yesterday"],
                    "parameters": {"content_type": "datetime"},
                }
            ]
        }
        r = await http.post("/v2/models/text/infer", json=bad)
        assert r.status_code == 400 and r.json()["error"].startswith(
            "There was an error encoding / decoding the payload: "
        )
        np_req = {
            "parameters": {"content_type": "np"},
            "inputs": [
                {
                    "name": "input-1",
                    "datatype": "FP64",
                    "shape": [1, 4],
                    "data": [1, 2, 3, None],
                    "parameters": {"content_type": "np"},
                }
            ],
        }
        r = await http.post(
            "/v2/models/affine/infer", json=np_req
        )  # FP64 cast to the model's FP32 (content type given)
        doc = r.json()
        assert r.status_code == 200 and doc["parameters"] == {"content_type": "np"}
        assert doc["outputs"][0]["data"] == [None, None] and doc["outputs"][0]["parameters"] == {"content_type": "np"}
        pd_req = {
            "parameters": {"content_type": "pd"},
            "inputs": [
                {"name": "a", "datatype": "FP64", "shape": [2, 1], "data": [1, 2]},
                {"name": "b", "datatype": "FP64", "shape": [2, 1], "data": [3, 4]},
                {"name": "c", "datatype": "FP64", "shape": [2, 1], "data": [5, 6]},
                {"name": "d", "datatype": "FP64", "shape": [2, 1], "data": [7, 8]},
            ],
        }
        r = await http.post("/v2/models/affine/infer", json=pd_req)
        doc = r.json()
        assert r.status_code == 200 and doc["parameters"] == {"content_type": "pd"}
        y, best = doc["outputs"]
        assert y["shape"] == [2, 1] and y["datatype"] == "BYTES" and y["parameters"] == {"content_type": "pd_json"}
        assert [json.loads(v) for v in y["data"]] == [[0.5, 26.25], [2.5, 29.75]]
        assert best == {"name": "best", "datatype": "INT64", "shape": [2, 1], "data": [1, 1]}


@pytest.mark.parametrize(
    ("model", "body", "status", "message"),
    [
        ("nope", infer_body("x", "FP32", [1], [1]), 404, "Model nope not found"),
        ("loading", infer_body("x", "FP32", [1, 4], [1, 2, 3, 4]), 503, "Model loading is not ready yet."),
        ("affine", infer_body("x", "FP32", [1, 4], [1, 2, 3]), 400, "shape [1, 4] needs 4 elements, got 3"),
        ("affine", infer_body("x", "FP32", [1, 4], [[1, 2], [3, 4, 5]]), 400, "needs 4 elements, got 5"),
        (
            "affine",
            infer_body("x", "FP32", [1, 3], [1, 2, 3]),
            400,
            "unexpected shape for input 'x' for model 'affine'. Expected [-1,4], got [1,3]",
        ),
        (
            "affine",
            infer_body("x", "FP64", [1, 4], [1, 2, 3, 4]),
            400,
            "inference input 'x' data-type is 'FP64', but model 'affine' expects 'FP32'",
        ),
        ("affine", infer_body("x", "FP8", [1, 4], [1, 2, 3, 4]), 400, "invalid datatype for input x"),
        ("affine", infer_body("x", "FP32", [1, -4], [1, 2, 3, 4]), 400, "invalid shape for input 'x'"),
        ("affine", infer_body("x", "FP32", [1, 4], ["a", 2, 3, 4]), 400, "expected a number for FP32, got string"),
        ("two", infer_body("zz", "FP32", [1], [1]), 400, "unexpected inference input 'zz' for model 'two'"),
        ("two", infer_body("a", "FP64", [1, 2], [1, 2]), 400, "expected 2 inputs but got 1 inputs for model 'two'"),
        (
            "affine",
            {**infer_body("x", "FP32", [1, 4], [1, 2, 3, 4]), "outputs": [{"name": "z"}]},
            400,
            "unexpected inference output 'z' for model 'affine'",
        ),
        ("affine", {"inputs": []}, 400, "the inference request needs a non-empty 'inputs' list"),
        (
            "affine",
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]},
            400,
            "'data' field is missing for input 'x' for model 'affine'",
        ),
        ("affine", {**infer_body("x", "FP32", [1, 4], [1, 2, 3, 4]), "id": 5}, 400, "'id' must be a string"),
        ("affine", [1, 2], 400, "the inference request must be a JSON object"),
    ],
)
async def test_infer_errors(app, model, body, status, message):
    async with client(app) as http:
        r = await http.post(f"/v2/models/{model}/infer", json=body)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[" * 50_000,
        b"\xff\xfe",
        b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [' + b"[" * 5000 + b"]" * 5000 + b"]}]}",
        b'{"inputs": 3}',
        b'{"inputs": [null]}',
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": "1", "data": [1]}]}',
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4], "parameters": 3}]}',
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": {"a": 1}}]}',
    ],
)
async def test_malformed_bodies_are_400_json(app, body):
    async with client(app) as http:
        r = await http.post("/v2/models/affine/infer", content=body)
    assert r.status_code == 400, r.text
    assert "error" in r.json()


@pytest.mark.parametrize(
    ("header", "tail", "message"),
    [
        ("x", b"", "Unable to parse Inference-Header-Content-Length, got: x"),
        ("999", b"", "inference header size should be in range"),
        (None, b"\x00\x00\x00", "unexpected additional input data for model 'affine': 3 bytes are not claimed"),
        (None, b"\x00", "unexpected size for input 'x', expecting 15 additional bytes for model 'affine'"),
    ],
)
async def test_binary_errors(app, header, tail, message):
    head = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    body = head + (b"\x00" * 16 + tail if "claimed" in message else tail)
    async with client(app) as http:
        r = await http.post(
            "/v2/models/affine/infer",
            content=body,
            headers={"Inference-Header-Content-Length": header or str(len(head))},
        )
    assert r.status_code == 400 and message in r.json()["error"]


async def test_server_ready_once_every_model_is(app):
    ready = tensor_app({"affine": affine_model()})
    async with client(ready) as http:
        r = await http.get("/v2/health/ready")
    assert (r.status_code, r.headers["content-type"], r.content) == (200, "application/json", b'{"ready": true}')


async def test_health_bodies_as_the_kserve_sdk_reads_them(app):
    """What KServe's InferenceRESTClient (v2) does with the answers: `is_server_live` / `is_server_ready`
    return the body's `live` / `ready` after a 2xx (and raise with the body's `error` otherwise, reading
    it only when Content-Type is exactly application/json); `is_model_ready` looks at the status only."""
    ready_app = tensor_app({"affine": affine_model()})
    async with client(ready_app) as http:
        live, ready = await http.get("/v2/health/live"), await http.get("/v2/health/ready")
        assert live.is_success and live.json().get("live") is True
        assert ready.is_success and ready.json().get("ready") is True
        assert (await http.get("/v2/models/affine/ready")).is_success
    async with client(app) as http:  # "loading" is not ready
        ready = await http.get("/v2/health/ready")
        assert not ready.is_success and ready.headers["content-type"] == "application/json"
        assert ready.json()["error"] == "Server is not ready."
        assert not (await http.get("/v2/models/loading/ready")).is_success


async def test_health_metadata_and_unknown_routes(app):
    async with client(app) as http:
        r = await http.get("/v2/health/live")
        assert (r.status_code, r.headers["content-type"], r.content) == (200, "application/json", b'{"live": true}')
        ready = await http.get("/v2/health/ready")  # "loading" is not ready
        assert (ready.status_code, ready.content) == (503, b'{"error": "Server is not ready.", "ready": false}')
        for path in ("/v2/models/affine/ready", "/v2/models/affine/versions/1/ready"):
            r = await http.get(path)
            assert (r.status_code, r.content) == (200, b'{"name": "affine", "ready": true}'), path
        r = await http.get("/v2/models/loading/ready")
        assert (r.status_code, r.content) == (503, b'{"error": "Model loading is not ready yet.", "ready": false}')
        r = await http.get("/v2/models/nope/ready")
        assert (r.status_code, r.content) == (404, b'{"error": "Model nope not found"}')
        r = await http.get("/v2/models/affine/versions/2/ready")
        assert r.status_code == 404 and r.json() == {"error": "Model affine with version 2 not found"}
        meta = (await http.get("/v2/models/affine")).json()
        assert meta == {
            "name": "affine",
            "versions": ["1"],
            "platform": "lmiserve_torchscript",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": [-1, 2]},
                {"name": "best", "datatype": "INT64", "shape": [-1]},
            ],
        }
        server = (await http.get("/v2")).json()
        assert server["name"] == "lmiserve" and "binary_tensor_data" in server["extensions"]
        r = await http.get("/v2/nothing/here")
        assert r.status_code == 404 and r.json() == {"error": "Not Found: GET /v2/nothing/here"}
        r = await http.get("/v2/models/affine/infer")
        assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}
        r = await http.post("/v2/models/affine/generate", json={"text_input": "hi"})
        assert r.status_code == 400 and "generate needs an LLM" in r.json()["error"]


async def test_requested_output_content_types(app):
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}],
        "outputs": [
            {"name": "upper", "parameters": {"content_type": "base64"}},
            {"name": "length", "parameters": {"content_type": "np"}},
        ],
    }
    async with client(app) as http:
        r = await http.post("/v2/models/text/infer", json=body)
        upper, length = r.json()["outputs"]
        assert upper == {
            "name": "upper",
            "datatype": "BYTES",
            "shape": [1],
            "data": ["SEk="],
            "parameters": {"content_type": "base64"},
        }
        assert length["parameters"] == {"content_type": "np"} and length["data"] == [2]
        body["outputs"] = [{"name": "length", "parameters": {"content_type": "base64"}}]
        r = await http.post("/v2/models/text/infer", json=body)
        assert r.status_code == 400 and "needs BYTES" in r.json()["error"]


async def test_repository_index(app):
    async with client(app) as http:
        index = (await http.post("/v2/repository/index")).json()
        assert {"name": "loading", "version": "1", "state": "LOADING", "reason": ""} in index
        assert {"name": "affine", "version": "1", "state": "READY", "reason": ""} in index
        ready = (await http.post("/v2/repository/index", json={"ready": True})).json()
        assert "loading" not in {m["name"] for m in ready} and "affine" in {m["name"] for m in ready}
