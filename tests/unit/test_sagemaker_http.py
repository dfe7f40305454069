"""SageMaker /invocations content types in process, on numpy TensorModels: JSON, JSON Lines, CSV bodies;
Accept negotiation (406), unsupported Content-Type (415), multi-record order, custom attributes."""

from __future__ import annotations

import json

import pytest

from helpers.tensor_app import (
    affine_model,
    classifier_model,
    client,
    tensor_app,
    text_model,
)
from lmiserve.core.errors import NotAcceptable
from lmiserve.protocols.tensor.codecs import records
from lmiserve.protocols.tensor.sagemaker import parse as sagemaker
from lmiserve.protocols.tensor.sagemaker.errors import RENDERER

ATTR = "X-Amzn-SageMaker-Custom-Attributes"


@pytest.fixture
def app():
    return tensor_app({"affine": affine_model(), "text": text_model(), "cls": classifier_model()})


async def post(app, body, content_type, accept=None, model="affine", **headers):
    hdrs = {"content-type": content_type, **({"accept": accept} if accept else {}), **headers}
    async with client(app) as http:
        return await http.post("/invocations", content=body, headers=hdrs, params={"model_name": model})


async def test_csv_in_csv_out(app):
    r = await post(app, b'1,2,3,4\r\n\r\n5,"6",7,8\n', "text/csv")
    assert r.status_code == 200 and r.headers["content-type"] == "text/csv"
    assert r.text == "1.5,14.75,1\n9.5,28.75,1\n"


async def test_csv_label_size_and_json_accept(app):
    r = await post(app, b"9,1,2,3,4\n9,5,6,7,8\n", "text/csv; label_size=1; charset=utf-8", "application/json")
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"predictions": [{"y": [1.5, 14.75], "best": 1}, {"y": [9.5, 28.75], "best": 1}]}


async def test_csv_empty_field_is_nan_and_answers_null(app):
    r = await post(app, b"1,,3,4\n", "text/csv", "application/jsonlines")
    assert r.text == '{"y": [null, null], "best": 0}\n'


async def test_jsonlines_in_jsonlines_out_keeps_order(app):
    body = b'[1, 2, 3, 4]\n[5, 6, 7, 8]\n{"features": [0, 0, 0, 0]}\n'
    r = await post(app, body, "application/jsonlines")
    assert r.headers["content-type"] == "application/jsonlines"
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert [line["best"] for line in lines] == [1, 1, 0] and lines[2]["y"] == [0.5, -0.25]


async def test_json_with_several_values_is_json_lines_and_instances_document(app):
    r = await post(app, b"[1, 2, 3, 4] [5, 6, 7, 8]", "application/json")
    assert len(r.json()["predictions"]) == 2
    r = await post(app, b'{"instances": [[1, 2, 3, 4]]}', "application/json")
    assert r.json() == {"predictions": [{"y": [1.5, 14.75], "best": 1}]}


async def test_text_model_csv_and_json(app):
    r = await post(app, b'hello\n"a, b"\n', "text/csv", model="text")
    assert r.text == 'HELLO,5\n"A, B",4\n'
    r = await post(app, b'["x", "yz"]', "application/json", model="text")
    assert r.json() == {"predictions": [{"upper": "X", "length": 1}, {"upper": "YZ", "length": 2}]}


async def test_custom_attributes_select_model_method_and_are_echoed(app):
    attrs = "tfs-model-name=cls,tfs-method=classify"
    r = await post(app, b'{"examples": [{"text": "good"}]}', "application/json", **{ATTR: attrs})
    assert r.status_code == 200 and r.headers[ATTR] == attrs
    assert r.json() == {"results": [[["negative", 0.25], ["positive", 0.75]]]}


@pytest.mark.parametrize(
    ("content_type", "accept", "body", "status", "message"),
    [
        ("application/x-npy", None, b"x", 415, "Unsupported Media Type: application/x-npy"),
        (
            "text/csv",
            "application/x-recordio-protobuf",
            b"1,2,3,4",
            406,
            "Accept type application/x-recordio-protobuf is not supported",
        ),
        ("text/csv", None, b"1,2,3", 400, "unexpected shape for input 'x'"),
        ("text/csv", None, b"\n\n", 400, "the request body is empty"),
        ("text/csv", None, b'1,"2', 400, "invalid CSV"),
        ("text/csv; label_size=x", None, b"1,2", 400, "invalid label_size"),
        ("text/csv; label_size=4", None, b"1,2,3,4", 400, "no feature columns"),
        ("application/json", None, b"[1, 2, 3, 4", 400, "invalid JSON"),
        (
            "application/jsonlines",
            None,
            b'[1, 2, 3, 4]\n{"a": 1, "b": 2}',
            400,
            "Expecting value/list but got object at item 1",
        ),
        ("application/json", None, b'{"instances": [[1, 2, "x", 4]]}', 400, "is not of expected type: float"),
    ],
)
async def test_errors(app, content_type, accept, body, status, message):
    r = await post(app, body, content_type, accept)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert message in r.json()["error"]


def test_negotiation_rules():
    assert sagemaker.negotiate(None, "text/csv", None) == "text/csv"
    assert sagemaker.negotiate("*/*", "text/csv", "application/json") == "application/json"
    assert sagemaker.negotiate("image/png, application/jsonlines;q=0.5", "text/csv", None) == "application/jsonlines"
    assert sagemaker.negotiate("application/jsons", "text/csv", None) == "application/jsonlines"
    with pytest.raises(NotAcceptable) as info:
        sagemaker.negotiate("image/png", "text/csv", None)
    assert RENDERER.status(info.value) == 406
    assert sagemaker.custom_attributes("tfs-model-name=a, tfs-method=regress,junk") == {
        "tfs-model-name": "a",
        "tfs-method": "regress",
    }


def test_csv_codec():
    assert records.parse_csv('1,"2",3\r\n"a ""q""",b\n') == [[1.0, 2.0, 3.0], ['a "q"', "b"]]
    assert records.to_csv([[1.5, "a,b", None], 'say "hi"']) == b'1.5,"a,b",\n"say ""hi"""\n'
    assert records.parse_media_type("Text/CSV; Label_Size=2") == ("text/csv", {"label_size": "2"})


async def test_lmi_payloads_stay_lmi_for_one_shot_models(app):
    r = await post(app, b'{"inputs": [[1, 2, 3, 4]]}', "application/json")
    assert r.status_code == 200
    assert r.json() == {
        "y": [[1.5, 14.75]],
        "best": [1],
    }  # LMI's answer for a TorchScript model (protocols/lmi/tensor.py)
    r = await post(app, b"hello", "text/plain", model="text")
    assert r.status_code == 200 and r.json() == {"upper": ["HELLO"], "length": [5]}


async def test_execution_parameters(app):
    async with client(app) as http:
        r = await http.get("/execution-parameters")
    assert r.json() == {"MaxConcurrentTransforms": 8, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}
