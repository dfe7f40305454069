"""TF Serving request parsing: paths, row and columnar tensors, messages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmiserve.core.errors import InvalidRequest, LmiServeError
from lmiserve.core.tensors import ModelSignature, TensorSpec
from lmiserve.protocols.tensor.tfserving import parse as tfserving
from lmiserve.protocols.tensor.tfserving.errors import RENDERER


def sig(*inputs: tuple[str, str, tuple[int, ...]]) -> ModelSignature:
    return ModelSignature(inputs=tuple(TensorSpec(*i) for i in inputs), outputs=(TensorSpec("y", "FP32", (-1,)),))


X4 = sig(("x", "FP32", (-1, 4)))
TWO = sig(("a", "FP64", (-1, 2)), ("b", "INT32", (-1,)))
TEXT = sig(("text", "BYTES", (-1,)))


def parse(doc, signature=X4):
    return tfserving.parse_predict(doc, signature, "m")


def error_of(doc, signature=X4) -> LmiServeError:
    with pytest.raises(LmiServeError) as info:
        parse(doc, signature)
    return info.value


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/models/m:predict", tfserving.Target("m", method="predict")),
        ("POST", "/v1/models/m/versions/1:classify", tfserving.Target("m", version="1", method="classify")),
        ("POST", "/v1/models/m/labels/stable:regress", tfserving.Target("m", label="stable", method="regress")),
        ("POST", "/v1/models/a%2Fb%3Ac:predict", tfserving.Target("a/b:c", method="predict")),
        ("GET", "/v1/models/m", tfserving.Target("m")),
        ("GET", "/v1/models/m/versions/1", tfserving.Target("m", version="1")),
        ("GET", "/v1/models/m/metadata", tfserving.Target("m", metadata=True)),
        ("GET", "/v1/models/m/versions/1/metadata", tfserving.Target("m", version="1", metadata=True)),
        ("GET", "/v1/models/m/METADATA", tfserving.Target("m")),
    ],
)
def test_paths(method, path, expected):
    assert tfserving.parse_path(method, path) == expected


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("POST", "/v1/models/m:PREDICT", "Malformed request: POST /v1/models/m:PREDICT"),
        ("POST", "/v1/models/m", "Malformed request: POST /v1/models/m"),
        ("POST", "/v1/models/m/version/1:predict", "Malformed request: POST /v1/models/m/version/1:predict"),
        ("POST", "/v1/models/m/label/x:predict", "Malformed request: POST /v1/models/m/label/x:predict"),
        (
            "POST",
            "/v1/models/m/versions/1/labels/x:predict",
            "Malformed request: POST /v1/models/m/versions/1/labels/x:predict",
        ),
        ("GET", "/v1/models/m:predict", "Malformed request: GET /v1/models/m:predict"),
        ("GET", "/v1/models/m/other", "Malformed request: GET /v1/models/m/other"),
        ("PUT", "/v1/models/m", "Malformed request: PUT /v1/models/m"),
        ("POST", "/v1/models/m/versions/abc:predict", "Failed to convert version: abc to numeric."),
        (
            "POST",
            "/v1/models/m/versions/99999999999999999999:predict",
            "Failed to convert version: 99999999999999999999 to numeric.",
        ),
        ("GET", "/v1/models/", "Missing model name in request."),
    ],
)
def test_bad_paths(method, path, message):
    with pytest.raises(LmiServeError) as info:
        tfserving.parse_path(method, path)
    assert info.value.message == message and RENDERER.status(info.value) == 400


def test_row_format_single_input():
    request, key = parse({"instances": [[1, 2, 3, 4], [5, 6, 7, 8.5]]})
    assert key == "predictions"
    x = request.inputs["x"]
    assert x.dtype == np.float32 and x.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8.5]]


def test_columnar_format_and_number_tokens():
    request, key = parse({"inputs": [[1, float("nan"), math.inf, -1e40]]})
    assert key == "outputs"
    x = request.inputs["x"]
    assert math.isnan(x[0, 1]) and x[0, 2] == np.inf and x[0, 3] == -np.inf  # beyond float range -> -inf


def test_row_format_named_inputs_and_columnar_object():
    request, _ = parse({"instances": [{"a": [1, 2], "b": 3}, {"a": [0.5, 0], "b": -4}]}, TWO)
    assert request.inputs["a"].tolist() == [[1, 2], [0.5, 0]] and request.inputs["b"].tolist() == [3, -4]
    request, _ = parse({"inputs": {"a": [[1, 2]], "b": [7], "ignored": 1}}, TWO)
    assert request.inputs["b"].dtype == np.int32


def test_strings_b64_and_parameters():
    request, _ = parse({"instances": ["hi", {"b64": "aGk="}], "parameters": {"max_new_tokens": 3}}, TEXT)
    assert request.inputs["text"].tolist() == [b"hi", b"hi"]
    assert request.parameters == {"max_new_tokens": 3}


def test_n_for_minus_one_by_one_is_reshaped():
    request, _ = parse({"instances": [1.0, 2.0]}, sig(("x", "FP32", (-1, 1))))
    assert request.inputs["x"].shape == (2, 1)


@pytest.mark.parametrize(
    ("doc", "signature", "message"),
    [
        ([1], X4, "JSON Value: [1] Is not object"),
        (
            {"signature_name": 1, "instances": [1]},
            X4,
            'JSON Value: {\n    "signature_name": 1,\n    "instances": [1]\n} not formatted correctly. \'signature_name\' key must be a string value.',
        ),
        (
            {"signature_name": "other", "instances": [1]},
            X4,
            'Serving signature name: "other" not found in signature def',
        ),
        (
            {"instances": [1], "inputs": [1]},
            X4,
            "JSON Value: {\n    \"instances\": [1],\n    \"inputs\": [1]\n} Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist ",
        ),
        ({"x": 1}, X4, "Missing 'inputs' or 'instances' key"),
        ({"instances": 1}, X4, "JSON Value: {\n    \"instances\": 1\n} Expecting 'instances' to be an list/array"),
        ({"instances": []}, X4, "JSON Value: {\n    \"instances\": []\n} No values in 'instances' array"),
        (
            {"instances": [[1, 2]]},
            TWO,
            "instances is a plain list, but expecting list of objects as multiple input tensors required as per tensorinfo_map",
        ),
        ({"instances": [{"a": [1, 2], "b": 1}, [1]]}, TWO, "Expecting object but got list at item 1 of input list"),
        ({"instances": [[1, 2, 3, 4], {"x": 1}]}, X4, "Expecting value/list but got object at item 1 of input list"),
        (
            {"instances": [{"a": [1, 2], "c": 1}]},
            TWO,
            "Failed to process element: 0 key: c of 'instances' list. Error: INVALID_ARGUMENT: JSON object: does not have named input: c",
        ),
        (
            {"instances": [{"a": [1, 2]}]},
            TWO,
            "Failed to process element: 0 of 'instances' list. JSON object: {\n    \"a\": [1, 2]\n} keys must be equal to: a,b",
        ),
        ({"instances": [[1, 2, 3, 4], [1, 2, 3]]}, X4, "Expecting tensor size: 4 but got: 3"),
        ({"instances": [[[1, 2], [3, 4]], [1, 2, 3, 4]]}, X4, "Expecting shape [2,2] but got: [4]"),
        ({"instances": [[[1, 2], [3, 4]], [[1, 2, 3, 4]]]}, X4, "Expecting shape [2,2] but got: [1,4]"),
        (
            {"instances": [[1, [2], 3, 4]]},
            X4,
            "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: Encountered list at unexpected level: 1 expected < 1",
        ),
        (
            {"instances": [[[1, 2], 3]]},
            X4,
            "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: 3 found at incorrect level: 2 in the JSON DOM. Expected at level: 2",
        ),
        (
            {"instances": [[[1, 2], [3]]]},
            X4,
            "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: Encountered list at unexpected size: 1 at level: 1 expected size: 2",
        ),
        (
            {"instances": [[1, 2, "3", 4]]},
            X4,
            "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: \"3\" Type: String is not of expected type: float",
        ),
        ({"instances": [[1, 2, None, 4]]}, X4, "Type: Null is not of expected type: float"),
        ({"inputs": {"a": [[1, 2]], "b": [1.0]}}, TWO, "JSON Value: 1.0 Type: Number is not of expected type: int32"),
        (
            {"inputs": {"a": [[1, 2]], "b": [2**31]}},
            TWO,
            "JSON Value: 2147483648 Type: Number is not of expected type: int32",
        ),
        ({"inputs": {"a": [[1, 2]]}}, TWO, "Missing named input: b in 'inputs' object."),
        (
            {"inputs": [1, 2]},
            TWO,
            "inputs is a plain value/list, but expecting an object as multiple input tensors required as per tensorinfo_map",
        ),
        ({"instances": [{"b64": "!!!"}]}, TEXT, "Error: INVALID_ARGUMENT: Unable to base64 decode"),
        ({"instances": [{"b64": 1}]}, TEXT, 'JSON Value: {\n    "b64": 1\n} not formatted correctly for base64 data'),
        ({"instances": [{"text": {"b64": "aGk=", "x": 1}}]}, TEXT, "not formatted correctly for base64 data"),
        ({"instances": [True]}, TEXT, "JSON Value: true Type: True is not of expected type: string"),
        ({"instances": [[1, 2, 3]]}, X4, "unexpected shape for input 'x' for model 'm'. Expected [-1,4], got [1,3]"),
    ],
)
def test_predict_errors(doc, signature, message):
    error = error_of(doc, signature)
    assert error.message.endswith(message)  # wrapped element errors carry TF Serving's prefix
    assert RENDERER.status(error) == 400


def test_bool_takes_only_true_false():
    signature = sig(("f", "BOOL", (-1,)))
    assert parse({"instances": [True, False]}, signature)[0].inputs["f"].tolist() == [True, False]
    assert "Type: Number is not of expected type: bool" in error_of({"instances": [1]}, signature).message


def test_unsupported_dtype_is_501():
    error = error_of({"instances": [1.5]}, sig(("h", "FP16", (-1,))))
    assert RENDERER.status(error) == 501 and error.message == "Conversion of JSON Value: 1.5 to type: half"


def test_classify_and_regress_requests():
    request = tfserving.parse_examples(
        {"context": {"lang": "en"}, "examples": [{"text": "a"}, {"text": ["b"]}]}, "classify", "classifier", TEXT
    )
    assert request.inputs["text"].tolist() == [b"a", b"b"]
    for doc, message in [
        ({}, "JSON Value: {} When method is classify, key 'examples' is expected and was not found"),
        ({"examples": {}}, "JSON Value: {\n    \"examples\": {}\n} Expecting 'examples' value to be an list/array"),
        ({"examples": []}, "JSON Value: {\n    \"examples\": []\n} 'examples' value is an empty array"),
        ({"examples": [[1]]}, "Example must be JSON object but got JSON Array"),
    ]:
        with pytest.raises(LmiServeError) as info:
            tfserving.parse_examples(doc, "classify", "classifier", TEXT)
        assert info.value.message == message
    with pytest.raises(
        InvalidRequest,
        match="Expected regression signature method_name to be tensorflow/serving/regress. Was: tensorflow/serving/predict",
    ):
        tfserving.parse_examples({"examples": [{"text": "a"}]}, "regress", "embedding", TEXT)
