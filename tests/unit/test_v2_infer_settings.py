"""An LLM's generation settings on KServe V2 `/v2/models/{m}/infer` (issue 42, part 3), in process over the
scripted fake engine: `max_tokens` and the other spellings `/generate` takes are honoured in `parameters`
(they were ignored: the answer ran to the default length) and as input tensors beside `text_input`, as
TensorRT-LLM ensembles and litellm's Triton provider send them (JSON or binary); what cannot be honoured
is a 400 naming it. litellm's `/generate` body (`bad_words: [""]`, `stop_words: [""]`) is accepted.
gRPC's ModelInfer shares the code: tests/unit/test_grpc_service.py."""

from __future__ import annotations

import json
import struct

import pytest

from helpers.text_app import Script, text_app

FOX = " the quick brown fox jumps"


@pytest.fixture
def served():
    served = text_app()
    served.fake.reply(Script(text=FOX))
    return served


def prompt(text: str = "Hello") -> dict:
    return {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}


def text_output(response) -> str:
    assert response.status_code == 200, response.text
    [out] = response.json()["outputs"]
    return out["data"][0]


async def test_max_tokens_in_parameters_is_honoured(served):
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json={"inputs": [prompt()], "parameters": {"max_tokens": 2}})
        assert text_output(r) == " the quick"
        r = await http.post(
            "/v2/models/tiny/infer", json={"inputs": [prompt()], "parameters": {"max_new_tokens": 3, "min_tokens": 1}}
        )
        assert text_output(r) == " the quick brown"
    assert [(p.max_new_tokens, p.min_new_tokens) for p in (q.params for q in served.fake.requests)] == [(2, 0), (3, 1)]


async def test_litellms_infer_body_with_settings_as_tensors(served):
    """What litellm's Triton provider posts to /infer: the prompt, then every setting as a [1] tensor
    (INT32 for ints, FP32 for floats, BYTES else)."""
    body = {
        "inputs": [
            prompt("What is the capital of France?"),
            {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [3]},
            {"name": "temperature", "shape": [1], "datatype": "FP32", "data": [0.5]},
            {"name": "stop_words", "shape": [2], "datatype": "BYTES", "data": ["", "jumps"]},
        ]
    }
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json=body)
    assert text_output(r) == " the quick brown"
    [request] = served.fake.requests
    assert (request.params.max_new_tokens, request.params.temperature, request.params.do_sample) == (3, 0.5, True)
    assert request.params.stop_sequences == ["jumps"]  # TensorRT-LLM's empty word is no word


async def test_settings_as_binary_tensors(served):
    """Triton's binary extension: the setting tensors own their segments, in input order."""
    text = b"Hello"
    segments = [struct.pack("<I", len(text)) + text, struct.pack("<i", 2), b"\x01"]
    header = {
        "inputs": [
            {
                "name": "text_input",
                "datatype": "BYTES",
                "shape": [1],
                "parameters": {"binary_data_size": len(segments[0])},
            },
            {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "parameters": {"binary_data_size": 4}},
            {"name": "ignore_eos", "datatype": "BOOL", "shape": [1], "parameters": {"binary_data_size": 1}},
        ]
    }
    head = json.dumps(header).encode()
    async with served.client() as http:
        r = await http.post(
            "/v2/models/tiny/infer",
            content=head + b"".join(segments),
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
    assert text_output(r) == " the quick"
    [request] = served.fake.requests
    assert (request.params.max_new_tokens, request.params.ignore_eos_token) == (2, True)


@pytest.mark.parametrize(
    ("inputs", "parameters", "message"),
    [
        ([], {"maxtokens": 3}, "unknown parameter: maxtokens"),
        (
            [{"name": "maxtokens", "datatype": "INT32", "shape": [1], "data": [3]}],
            {},
            "unexpected inference input 'maxtokens' for model 'tiny'",
        ),
        (
            [{"name": "beam_width", "datatype": "INT32", "shape": [1], "data": [2]}],
            {},
            "parameter 'beam_width' is not supported: beam search is not supported (beam_width 1 only)",
        ),
        ([], {"return_log_probs": True}, "'return_log_probs' is not supported: /infer answers text_output only"),
        ([], {"n": 2, "temperature": 1.0}, "parameter 'n' is not supported: /infer answers one sequence (n 1 only)"),
        (
            [{"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [5]}],
            {"max_tokens": 6},
            "'max_tokens' is given as an input tensor and as a parameter, with different values",
        ),
        (
            [{"name": "max_tokens", "datatype": "INT32", "shape": [2], "data": [5, 6]}],
            {},
            "input 'max_tokens' must hold one value, got 2 (shape [2])",
        ),
        ([], {"max_tokens": 3, "max_new_tokens": 4}, "'max_tokens' and 'max_new_tokens' disagree; give one of them"),
        (
            [{"name": "temperature", "datatype": "BYTES", "shape": [1], "data": ["hot"]}],
            {},
            "Invalid value 'hot' for parameter 'temperature': Input should be a valid number, unable to parse string as a number",
        ),
    ],
    ids=[
        "unknown",
        "unknown-tensor",
        "unsupported",
        "output-switch",
        "n",
        "both-ways",
        "two-values",
        "disagree",
        "type",
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(served, inputs, parameters, message):
    body = {"inputs": [prompt(), *inputs], "parameters": parameters}
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json=body)
    assert (r.status_code, r.json()) == (400, {"error": message})
    assert served.fake.requests == []


async def test_transport_parameters_are_not_settings(served):
    """MLServer's content type and Triton's binary_data_output are the transport's, never refused."""
    body = {"inputs": [prompt()], "parameters": {"content_type": "str", "binary_data_output": False, "max_tokens": 1}}
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    assert served.fake.requests[0].params.max_new_tokens == 1


async def test_litellms_generate_body(served):
    """litellm's Triton /generate body: empty bad and stop words mean none."""
    body = {
        "text_input": "Hello",
        "parameters": {"max_tokens": 2, "bad_words": [""], "stop_words": [""]},
        "stream": False,
    }
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/generate", json=body)
    assert (r.status_code, r.json()["text_output"]) == (200, " the quick")
    [request] = served.fake.requests
    assert (request.params.max_new_tokens, request.params.stop_sequences) == (2, [])
