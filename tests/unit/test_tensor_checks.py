"""The one input check every tensor protocol and model runs (core.tensor_io): names, optional inputs,
datatypes, shapes, in Triton's words; and the V2 route publishing what it checks."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tensor_app import NumpyModel, client, tensor_app
from lmiserve.core.errors import InvalidInput
from lmiserve.core.tensor_io import check_names, conform
from lmiserve.core.tensors import ModelSignature, TensorSpec

SIGNATURE = ModelSignature(
    inputs=(
        TensorSpec("a", "FP32", (-1, 2)),
        TensorSpec("b", "INT32", (-1,)),
        TensorSpec("scale", "FP32", (1,), optional=True),
    ),
    outputs=(TensorSpec("total", "FP32", (-1,)),),
)


def message(call) -> str:
    with pytest.raises(InvalidInput) as info:
        call()
    return info.value.message


def test_names():
    check_names(["a", "b"], SIGNATURE, "m")
    check_names(["b", "a", "scale"], SIGNATURE, "m")
    assert message(lambda: check_names(["a", "z"], SIGNATURE, "m")) == "unexpected inference input 'z' for model 'm'"
    assert (
        message(lambda: check_names(["y", "a", "z"], SIGNATURE, "m"))
        == "unexpected inference inputs ['y','z'] for model 'm'"
    )
    assert message(lambda: check_names(["scale"], SIGNATURE, "m")) == (
        "expected number of inputs between 2 and 3 but got 1 inputs for model 'm'. Got input(s) ['scale'], "
        "but missing required input(s) ['a','b']. Please provide all required input(s)."
    )
    required_only = ModelSignature(inputs=SIGNATURE.inputs[:2], outputs=())
    assert message(lambda: check_names([], required_only, "m")) == (
        "expected 2 inputs but got 0 inputs for model 'm'. Got input(s) [], "
        "but missing required input(s) ['a','b']. Please provide all required input(s)."
    )


def test_datatypes_and_casts():
    a, b = np.zeros((3, 2), np.float32), np.zeros(3, np.int32)
    out = conform({"b": b, "a": a}, SIGNATURE, "m")
    assert list(out) == ["a", "b"]  # signature order; the optional input left out
    wide = np.zeros(3, np.int64)
    assert (
        message(lambda: conform({"a": a, "b": wide}, SIGNATURE, "m"))
        == "inference input 'b' data-type is 'INT64', but model 'm' expects 'INT32'"
    )
    assert conform({"a": a, "b": wide}, SIGNATURE, "m", castable={"b"})["b"].dtype == np.int32
    text = np.array([b"1", b"2", b"3"], dtype=object)
    assert (
        message(lambda: conform({"a": a, "b": text}, SIGNATURE, "m", castable={"b"}))
        == "inference input 'b' data-type is 'BYTES', but model 'm' expects 'INT32'"
    )
    odd = np.zeros(3, np.complex64)
    assert (
        message(lambda: conform({"a": a, "b": odd}, SIGNATURE, "m"))
        == "inference input 'b' data-type is 'complex64', but model 'm' expects 'INT32'"
    )


def test_shapes():
    b = np.zeros(3, np.int32)
    assert conform({"a": np.zeros((3, 2, 1), np.float32), "b": b}, SIGNATURE, "m")["a"].shape == (3, 2)
    for shape, given in [((3,), "[3]"), ((3, 3), "[3,3]"), ((1, 3, 2), "[1,3,2]")]:
        assert (
            message(lambda shape=shape: conform({"a": np.zeros(shape, np.float32), "b": b}, SIGNATURE, "m"))
            == f"unexpected shape for input 'a' for model 'm'. Expected [-1,2], got {given}"
        )
    scale = np.zeros(2, np.float32)
    assert (
        message(lambda: conform({"a": np.zeros((3, 2), np.float32), "b": b, "scale": scale}, SIGNATURE, "m"))
        == "unexpected shape for input 'scale' for model 'm'. Expected [1], got [2]"
    )


@pytest.fixture
def app():
    def fn(a, b, scale=None):
        total = a.sum(axis=1) + b
        return {"total": (total * (scale[0] if scale is not None else 1)).astype(np.float32)}

    return tensor_app({"scaled": NumpyModel("torchscript", SIGNATURE, fn)})


def infer_body(*inputs: tuple[str, str, list, list]) -> dict:
    return {"inputs": [{"name": n, "datatype": d, "shape": s, "data": v} for n, d, s, v in inputs]}


async def test_v2_optional_inputs_are_published_and_may_be_left_out(app):
    a, b = ("a", "FP32", [1, 2], [1, 2]), ("b", "INT32", [1], [3])
    async with client(app) as http:
        meta = (await http.get("/v2/models/scaled")).json()
        assert meta["inputs"][2] == {"name": "scale", "datatype": "FP32", "shape": [1], "optional": True}
        assert "optional" not in meta["inputs"][0]
        r = await http.post("/v2/models/scaled/infer", json=infer_body(a, b))
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [6.0]
        r = await http.post("/v2/models/scaled/infer", json=infer_body(a, b, ("scale", "FP32", [1], [2])))
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [12.0]
        r = await http.post("/v2/models/scaled/infer", json=infer_body(b, ("scale", "FP32", [1], [2])))
        assert r.status_code == 400
        assert r.json() == {
            "error": "expected number of inputs between 2 and 3 but got 2 inputs for model 'scaled'. "
            "Got input(s) ['b','scale'], but missing required input(s) ['a']. Please provide all required input(s)."
        }
        r = await http.post("/v2/models/scaled/infer", json=infer_body(a, b, a))
        assert (r.status_code, r.json()) == (400, {"error": "input 'a' is given more than once"})


async def test_vertex_and_sagemaker_records_name_the_undeclared_key():
    from helpers.tensor_app import affine_model

    app = tensor_app({"affine": affine_model()}, vertex_predict_route="/predict")
    async with client(app) as http:
        r = await http.post("/invocations", json=[{"nope": [1, 2, 3, 4]}])
        assert (r.status_code, r.json()) == (400, {"error": "unexpected inference input 'nope' for model 'affine'"})
        r = await http.post("/invocations", json=[{"features": [1, 2, 3, 4]}, {"x": [1, 2, 3, 4]}, [1, 2, 3, 4]])
        assert r.status_code == 200, r.text
        r = await http.post("/predict", json={"instances": [{"nope": [1, 2, 3, 4]}]})
        assert (r.status_code, r.json()) == (400, {"error": "unexpected inference input 'nope' for model 'affine'"})
        r = await http.post("/predict", json={"instances": [{"x": [1, 2, 3, 4]}, {"features": [1, 2, 3, 4]}]})
        assert r.status_code == 200, r.text
