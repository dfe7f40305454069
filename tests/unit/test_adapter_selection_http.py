"""The LoRA adapter each protocol's request names reaches the engine (`GenerationRequest.adapter`), in
process on the scripted fake engine (tests/helpers/text_app.py) given three adapter names; an unknown
one is each protocol's 404, byte for byte, before anything is generated (a stream's too). The same on
a real server with real adapters, their outputs checked against PEFT's: tests/integration/test_lora_protocols.py."""

from __future__ import annotations

import json

import pytest

from helpers.text_app import TextApp, text_app
from lmiserve.core import request_context
from lmiserve.core.adapters import resolve_adapter
from lmiserve.core.request_context import RequestFacts

ADAPTERS = {"alpha", "beta", "gamma"}
PROMPT = "Deep learning is"
MESSAGES = [{"role": "user", "content": "Hi"}]
SAGEMAKER = "X-Amzn-SageMaker-Adapter-Identifier"


def compact(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def with_adapters(**options) -> TextApp:
    served = text_app(**options)
    served.fake.adapters = ADAPTERS  # what `ModelService.adapters` reads (the engine's AdapterRegistry)
    return served


@pytest.fixture
def served() -> TextApp:
    return with_adapters()


def adapters_of(served) -> list[str | None]:
    return [r.adapter for r in served.fake.requests]


async def post(served, path: str, payload, **kwargs):
    async with served.client() as http:
        return await http.post(path, json=payload, **kwargs)


# --- TGI ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_tgi_adapter_id(served, path):
    for name, expected in (("alpha", "alpha"), ("gamma", "gamma"), ("tiny", None), ("", None), (None, None)):
        r = await post(served, path, {"inputs": PROMPT, "parameters": {"adapter_id": name, "max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert served.fake.requests[-1].adapter == expected
    r = await post(served, path, {"inputs": PROMPT, "parameters": {"adapter_id": "delta"}})
    assert (r.status_code, r.headers["content-type"]) == (404, "application/json")  # a response, even streaming
    assert r.content == b'{"error":"`adapter_id` names adapter `delta`, which is not served","error_type":"not_found"}'
    assert len(served.fake.requests) == 5


# --- OpenAI and Anthropic: `model` -------------------------------------------------------------------------


async def test_openai_chat_and_completions_model(served):
    r = await post(served, "/v1/chat/completions", {"model": "beta", "messages": MESSAGES, "max_tokens": 2})
    assert (r.status_code, r.json()["model"], adapters_of(served)) == (200, "beta", ["beta"])
    r = await post(served, "/v1/completions", {"model": "alpha", "prompt": [PROMPT, "Hi"], "max_tokens": 2})
    assert (r.status_code, r.json()["model"], adapters_of(served)[1:]) == (200, "alpha", ["alpha", "alpha"])
    r = await post(served, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert (r.status_code, r.json()["model"], adapters_of(served)[-1]) == (200, "tiny", None)
    for route, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": PROMPT})):
        r = await post(served, route, {**body, "model": "gamma", "max_tokens": 2, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        assert r.status_code == 200 and {c["model"] for c in chunks} == {"gamma"}
        assert adapters_of(served)[-1] == "gamma"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_openai_unknown_model_is_404_model_not_found(served, route, stream):
    body = {"/v1/chat/completions": {"messages": MESSAGES}, "/v1/completions": {"prompt": PROMPT}}.get(
        route, {"input": "Hi"}
    )
    r = await post(served, route, {**body, "model": "delta", "stream": stream})
    assert r.status_code == 404
    assert r.content == compact(
        {
            "error": {
                "message": "The model `delta` does not exist.",
                "type": "not_found_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
    )
    assert served.fake.requests == []


async def test_openai_responses_model(served):
    r = await post(served, "/v1/responses", {"model": "gamma", "input": "Hi", "max_output_tokens": 2})
    assert (r.status_code, r.json()["model"], adapters_of(served)) == (200, "gamma", ["gamma"])


async def test_anthropic_messages_model(served):
    body = {"model": "gamma", "max_tokens": 2, "messages": MESSAGES}
    r = await post(served, "/v1/messages", body)
    assert (r.status_code, r.json()["model"], adapters_of(served)) == (200, "gamma", ["gamma"])
    r = await post(served, "/v1/messages/count_tokens", {"model": "gamma", "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    for stream in (False, True):
        r = await post(served, "/v1/messages", {**body, "model": "delta", "stream": stream})
        assert r.status_code == 404
        assert r.content == b'{"type":"error","error":{"type":"not_found_error","message":"model: delta"}}'
    assert len(served.fake.requests) == 1


async def test_tokenize_takes_an_adapter_and_embeddings_refuse_it(served):
    r = await post(served, "/tokenize", {"model": "alpha", "prompt": "Hi there"})
    assert r.status_code == 200 and r.json()["count"] > 0
    r = await post(served, "/tokenize", {"model": "delta", "prompt": "Hi there"})
    assert r.status_code == 404
    r = await post(served, "/v1/embeddings", {"model": "alpha", "input": "Hi"})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        400,
        "`model` alpha is a LoRA adapter of the llm model tiny: this route needs an embedding model.",
        "model",
    )


# --- LMI -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "query", "headers", "expected"),
    [
        ({"adapters": "alpha"}, None, None, "alpha"),
        ({"adapters": ["beta"]}, None, None, "beta"),
        ({"parameters": {"adapter_id": "gamma"}}, None, None, "gamma"),
        ({}, {"adapter": "alpha"}, None, "alpha"),
        ({}, None, {SAGEMAKER: "beta"}, "beta"),
        # precedence: body `adapters` > parameters.adapter_id > ?adapter= > the SageMaker header
        ({"adapters": "alpha", "parameters": {"adapter_id": "beta"}}, {"adapter": "gamma"}, {SAGEMAKER: "x"}, "alpha"),
        ({"parameters": {"adapter_id": "beta"}}, {"adapter": "gamma"}, {SAGEMAKER: "x"}, "beta"),
        ({}, {"adapter": "gamma"}, {SAGEMAKER: "x"}, "gamma"),
        ({"adapters": "tiny"}, {"adapter": "gamma"}, None, None),  # the base model, named
        ({"adapters": None, "parameters": {"adapter_id": ""}}, None, None, None),
    ],
)
async def test_lmi_adapter_sources(served, body, query, headers, expected):
    async with served.client() as http:
        payload = {"inputs": PROMPT, **body, "parameters": {"max_new_tokens": 2, **body.get("parameters", {})}}
        r = await http.post("/invocations", json=payload, params=query, headers=headers)
    assert r.status_code == 200, r.text
    assert adapters_of(served) == [expected]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("body", "query", "headers", "field"),
    [
        ({"adapters": "delta"}, None, None, "adapters"),
        ({"adapters": ["delta"]}, None, None, "adapters"),
        ({"parameters": {"adapter_id": "delta"}}, None, None, "adapter_id"),
        ({}, {"adapter": "delta"}, None, "adapter"),
        ({}, None, {SAGEMAKER: "delta"}, SAGEMAKER),
    ],
)
async def test_lmi_unknown_adapter_is_404(served, body, query, headers, field, stream):
    async with served.client() as http:
        r = await http.post(
            "/invocations", json={"inputs": PROMPT, "stream": stream, **body}, params=query, headers=headers
        )
    assert (r.status_code, r.headers["content-type"]) == (404, "application/json")
    assert r.content == compact({"error": f"`{field}` names adapter `delta`, which is not served", "code": 404})
    assert served.fake.requests == []


async def test_lmi_predictions_route(served):
    async with served.client() as http:
        r = await http.post("/predictions/tiny", json={"inputs": PROMPT, "adapters": "gamma"}, params={"adapter": "x"})
    assert r.status_code == 200 and adapters_of(served) == ["gamma"]


async def test_lmi_dynamic_batch_one_adapter_per_input():
    served = with_adapters(rolling_batch="disable", batch_size=4)
    inputs = [PROMPT, "Hi", "Hello"]
    async with served.client() as http:
        r = await http.post("/invocations", json={"inputs": inputs, "adapters": ["alpha", "", "gamma"]})
        assert r.status_code == 200 and len(r.json()) == 3
        assert {(q.prompt, q.adapter) for q in served.fake.requests} == {
            (PROMPT, "alpha"),
            ("Hi", None),
            ("Hello", "gamma"),
        }
        r = await http.post("/invocations", json={"inputs": inputs, "adapters": "beta"})  # one name: every input
        assert r.status_code == 200 and adapters_of(served)[3:] == ["beta"] * 3
        r = await http.post("/invocations", json={"inputs": inputs, "adapters": ["alpha", "beta"]})
        assert (r.status_code, r.json()["code"]) == (424, 424)
        assert r.json()["error"] == (
            "Input Parsing failed. Ensure that the request payload is valid. Number of adapters is not equal to "
            "the number of inputs (2 adapters, 3 inputs)"
        )
        r = await http.post("/invocations", json={"inputs": inputs, "adapters": ["alpha", "delta", "gamma"]})
        assert r.status_code == 404 and "`delta`" in r.json()["error"]
        r = await http.post("/invocations", json={"inputs": PROMPT, "adapters": {"name": "alpha"}})
        assert r.status_code == 424 and "`adapters` must be an adapter's name" in r.json()["error"]
    assert len(served.fake.requests) == 6


async def test_invocations_header_applies_to_openai_and_tgi_bodies():
    """On /invocations, the query parameter or SageMaker's header names the adapter of an OpenAI or TGI
    body that names none itself; LMI's `adapters` field applies to TGI's body (tgi_compat) too."""
    served = with_adapters(tgi_compat=True)
    headers = {SAGEMAKER: "beta"}
    tgi = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    async with served.client() as http:
        r = await http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2}, headers=headers)
        assert (r.status_code, r.json()["model"]) == (200, "beta")
        r = await http.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2}, params={"adapter": "gamma"})
        assert (r.status_code, r.json()["model"]) == (200, "gamma")
        r = await http.post("/invocations", json=tgi, headers=headers)
        assert r.status_code == 200 and isinstance(r.json(), list)  # TGI's POST / (tgi_compat)
        body = {"messages": MESSAGES, "max_tokens": 2, "model": "tiny"}  # the body's own choice wins
        r = await http.post("/invocations", json=body, headers=headers)
        assert (r.status_code, r.json()["model"]) == (200, "tiny")
        r = await http.post("/invocations", json={**tgi, "parameters": {"adapter_id": "alpha"}}, headers=headers)
        assert r.status_code == 200
        for adapters in ("gamma", ["gamma"]):
            body = {**tgi, "adapters": adapters, "parameters": {"adapter_id": "alpha"}}
            r = await http.post("/invocations", json=body, headers=headers)
            assert r.status_code == 200
        r = await http.post("/invocations", json={**tgi, "adapters": "delta"})
        assert (r.status_code, r.json()["error_type"]) == (404, "not_found")
    assert adapters_of(served) == ["beta", "gamma", "beta", None, "alpha", "gamma", "gamma"]


async def test_invocations_pass_the_adapter_as_a_value_without_rewriting_the_body():
    """The dispatcher hands the protocol the adapter named outside the body; the body reaches it as sent: a
    TGI body without `parameters` keeps TGI's default for it (sampling). An unknown name is the protocol's
    404, as if its own field named it (TGI's `adapter_id`, OpenAI's `model`)."""
    served = with_adapters(tgi_compat=True)
    async with served.client() as http:
        r = await http.post("/invocations", json={"inputs": PROMPT}, headers={SAGEMAKER: "beta"})
        assert r.status_code == 200
        assert served.fake.requests[-1].adapter == "beta" and served.fake.requests[-1].params.do_sample
        r = await http.post("/invocations", json={"inputs": PROMPT}, params={"adapter": "delta"})
        assert (
            r.content == b'{"error":"`adapter_id` names adapter `delta`, which is not served","error_type":"not_found"}'
        )
        r = await http.post("/invocations", json={"messages": MESSAGES}, headers={SAGEMAKER: "delta"})
        assert (r.status_code, r.json()["error"]["message"]) == (404, "The model `delta` does not exist.")
    assert len(served.fake.requests) == 1


# --- tensor protocols ----------------------------------------------------------------------------------------


async def test_kserve_infer_adapter_id(served):
    body = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["Hello", "Hi"]}],
        "parameters": {"max_new_tokens": 2, "adapter_id": "beta"},
    }
    async with served.client() as http:
        r = await http.post("/v2/models/tiny/infer", json=body)
        assert r.status_code == 200 and adapters_of(served) == ["beta", "beta"]
        r = await http.post("/v2/models/tiny/infer", json={**body, "parameters": {"adapter_id": "delta"}})
    assert (r.status_code, r.content) == (404, b'{"error": "`adapter_id` names adapter `delta`, which is not served"}')


async def test_sagemaker_json_lines_name_an_adapter_per_line(served):
    lines = [
        {"inputs": PROMPT, "adapters": "alpha", "parameters": {"max_new_tokens": 2}},
        {"inputs": "Hi", "parameters": {"adapter_id": "beta", "max_new_tokens": 2}},
        {"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    async with served.client() as http:
        r = await http.post("/invocations", content=body, headers={"content-type": "application/jsonlines"})
        assert r.status_code == 200, r.text
        assert {(q.prompt, q.adapter) for q in served.fake.requests} == {
            (PROMPT, "alpha"),
            ("Hi", "beta"),
            ("Hello", None),
        }
        body = json.dumps({"inputs": "Hi", "adapters": "delta"}) + "\n"
        r = await http.post("/invocations", content=body, headers={"content-type": "application/jsonlines"})
    assert (r.status_code, r.json()) == (
        404,
        {"error": "line 1: `adapters` names adapter `delta`, which is not served"},
    )


def test_the_selected_adapter_is_noted_for_the_access_line():
    """`resolve_adapter` notes the adapter in the request's access facts (the access line's `adapter`);
    the base model's name notes none."""
    facts = RequestFacts("r1")
    token = request_context.bind(facts)
    try:
        assert resolve_adapter("tiny", ADAPTERS, ("tiny",)) is None
        assert facts.adapter is None
        assert resolve_adapter("alpha", ADAPTERS, ("tiny",)) == "alpha"
    finally:
        request_context.unbind(token)
    assert facts.adapter == "alpha"
