"""Anthropic Messages (POST /v1/messages, /v1/messages/count_tokens) over HTTP on the scripted fake engine
with the real tiny tokenizer and chat template (helpers.text_app): the message and its stop reasons, the
event stream (order, ``event:`` lines, text equal to the whole answer's), tool use and tool results,
prefill, thinking blocks, the API key in ``x-api-key``, and every refusal in Anthropic's error shape.
The real `anthropic` client on a real server: tests/integration/test_anthropic_clients.py."""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from helpers.text_app import Script, text_app
from helpers.tiny_model import build_thinking_tokenizer
from lmiserve.core.errors import Overloaded

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
BODY = {"model": "tiny", "max_tokens": 12, "messages": MESSAGES}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
CALL = '{"name":"get_weather","parameters":{"city":"Paris","unit":"c"}}'


@pytest.fixture
def served():
    return text_app(max_context=4096)


async def post(served, body, path: str = "/v1/messages", **kwargs) -> httpx.Response:
    async with served.client() as http:
        return await http.post(path, json=body, **kwargs)


def events(r: httpx.Response) -> list[dict]:
    """The SSE events, each checked to be `event: <its type>` then one `data:` line."""
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream", r.text
    out = []
    for raw in r.text.split("\n\n")[:-1]:
        name, data = raw.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert name == f"event: {obj['type']}", raw
        out.append(obj)
    assert r.text.endswith("\n\n")
    return out


def streamed(evs: list[dict]) -> dict:
    """The message the events build, as the SDK's accumulator builds it."""
    message = evs[0]["message"]
    partial: dict[int, str] = {}
    for e in evs[1:]:
        if e["type"] == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
        elif e["type"] == "content_block_stop" and e["index"] in partial:
            message["content"][e["index"]]["input"] = json.loads(partial[e["index"]])
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"] = e["usage"]
    return message


def error(r: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def normal(message: dict) -> dict:
    return {**message, "id": "msg", "content": [{**b, "id": "toolu"} if "id" in b else b for b in message["content"]]}


# --- the message -----------------------------------------------------------------------------------------------------


async def test_a_message_and_its_stream(served):
    served.fake.reply(Script(text=" Paris is the capital."))
    r = await post(served, {**BODY, "system": "Be brief.", "temperature": 0})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    message = r.json()
    assert list(message) == ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"]
    assert message["id"].startswith("msg_") and len(message["id"]) == 28
    assert (message["type"], message["role"], message["model"]) == ("message", "assistant", "tiny")
    assert message["content"] == [{"type": "text", "text": " Paris is the capital."}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)
    assert message["usage"]["output_tokens"] > 0 and message["usage"]["cache_creation_input_tokens"] == 0
    prompt = served.fake.requests[-1].prompt
    assert "Be brief." in prompt and prompt.index("Be brief.") < prompt.index("capital of France")
    assert served.fake.requests[-1].params.do_sample is False

    served.fake.reply(Script(text=" Paris is the capital."))
    evs = events(await post(served, {**BODY, "system": "Be brief.", "temperature": 0, "stream": True}))
    kinds = [e["type"] for e in evs]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert evs[0]["message"]["stop_reason"] is None and evs[0]["message"]["content"] == []
    assert evs[0]["message"]["usage"]["input_tokens"] == message["usage"]["input_tokens"]
    assert normal(streamed(evs)) == normal(message)


async def test_stop_reasons(served):
    served.fake.reply(Script(text=" Paris is the capital.", eos=False))
    message = (await post(served, {**BODY, "max_tokens": 2})).json()
    assert (message["stop_reason"], message["stop_sequence"], message["usage"]["output_tokens"]) == (
        "max_tokens",
        None,
        2,
    )
    served.fake.reply(Script(text=" Paris is the capital."))
    message = (await post(served, {**BODY, "stop_sequences": ["zzz", "the"]})).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "the")
    assert message["content"] == [{"type": "text", "text": " Paris is "}]  # the stop sequence left out
    served.fake.reply(Script(text=" Paris is the capital."))
    evs = events(await post(served, {**BODY, "stop_sequences": ["the"], "stream": True}))
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "the"}
    assert streamed(evs)["content"] == message["content"]


async def test_an_empty_answer_has_no_block(served):
    served.fake.reply(Script(text=""))
    message = (await post(served, BODY)).json()
    assert message["content"] == [] and message["stop_reason"] == "end_turn"
    served.fake.reply(Script(text=""))
    kinds = [e["type"] for e in events(await post(served, {**BODY, "stream": True}))]
    assert kinds == ["message_start", "ping", "message_delta", "message_stop"]


async def test_sampling_fields_reach_the_engine(served):
    served.fake.reply(Script(text=" Paris."))
    r = await post(served, {**BODY, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u1"}})
    assert r.status_code == 200, r.text
    params = served.fake.requests[-1].params
    assert (params.do_sample, params.temperature, params.top_p, params.top_k) == (True, 0.5, 0.9, 5)
    served.fake.reply(Script(text=" Paris."))
    await post(served, BODY)  # Anthropic's default: sampled at temperature 1
    params = served.fake.requests[-1].params
    assert (params.do_sample, params.temperature, params.top_p, params.top_k) == (True, 1.0, 1.0, 0)


async def test_multi_turn_and_prefill(served):
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a city."},
    ]
    served.fake.reply(Script(text=" Paris."))
    assert (await post(served, {**BODY, "messages": turns})).status_code == 200
    prompt = served.fake.requests[-1].prompt
    assert prompt.index("Hi\n\nthere") < prompt.index("Hello!") < prompt.index("Name a city.")
    # a last assistant message is continued: the prompt ends with its text, the answer goes on from it
    served.fake.reply(Script(text=" Paris."))
    prefill = [*turns, {"role": "assistant", "content": "The city is"}]
    assert (await post(served, {**BODY, "messages": prefill})).json()["content"][0]["text"] == " Paris."
    assert served.fake.requests[-1].prompt.rstrip().endswith("The city is")
    bad = [*turns, {"role": "assistant", "content": "The city is "}]
    message = error(await post(served, {**BODY, "messages": bad}), 400)
    assert message == "messages: final assistant content cannot end with trailing whitespace"


async def test_count_tokens_counts_the_rendered_prompt(served):
    served.fake.reply(Script(text=" Paris."))
    body = {**BODY, "system": [{"type": "text", "text": "Be brief."}]}
    message = (await post(served, body)).json()
    r = await post(served, {k: body[k] for k in ("model", "messages", "system")}, "/v1/messages/count_tokens")
    assert r.status_code == 200 and r.json() == {"input_tokens": message["usage"]["input_tokens"]}
    counted = (
        await post(served, {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]}, "/v1/messages/count_tokens")
    ).json()
    assert counted["input_tokens"] > r.json()["input_tokens"]  # the tools' prompt counts
    assert "max_tokens" in error(
        await post(served, {"model": "tiny", "messages": MESSAGES, "max_tokens": 3}, "/v1/messages/count_tokens"), 400
    )


# --- tools -----------------------------------------------------------------------------------------------------------


async def test_a_forced_tool_call(served):
    body = {**BODY, "max_tokens": 60, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    served.fake.reply(Script(text=CALL))
    message = (await post(served, body)).json()
    [block] = message["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and len(block["id"]) == 30
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Paris", "unit": "c"})
    assert message["stop_reason"] == "tool_use"
    assert served.fake.requests[-1].params.grammar is not None  # generated under the tool's schema

    served.fake.reply(Script(text=CALL))
    evs = events(await post(served, {**body, "stream": True}))
    start = next(e for e in evs if e["type"] == "content_block_start")
    assert start["content_block"]["input"] == {} and start["content_block"]["name"] == "get_weather"
    pieces = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == block["input"]
    assert normal(streamed(evs)) == normal(message)


async def test_auto_answers_text_when_the_model_does_not_call(served):
    served.fake.reply(Script(text='{"content":"It is sunny."}'))
    message = (await post(served, {**BODY, "max_tokens": 60, "tools": [WEATHER]})).json()
    assert message["content"] == [{"type": "text", "text": "It is sunny."}] and message["stop_reason"] == "end_turn"
    served.fake.reply(Script(text='{"content":"It is sunny."}'))
    evs = events(await post(served, {**BODY, "max_tokens": 60, "tools": [WEATHER], "stream": True}))
    assert streamed(evs)["content"] == message["content"]


async def test_tool_choice_modes(served):
    served.fake.reply(Script(text=" Paris."))
    none = await post(served, {**BODY, "tools": [WEATHER], "tool_choice": {"type": "none"}})
    assert none.json()["content"] == [{"type": "text", "text": " Paris."}]
    assert served.fake.requests[-1].params.grammar is None and "get_weather" not in served.fake.requests[-1].prompt
    served.fake.reply(Script(text="[" + CALL + "," + CALL + "]"))
    two = await post(served, {**BODY, "max_tokens": 200, "tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert [b["name"] for b in two.json()["content"]] == ["get_weather", "get_weather"]
    one = {"type": "any", "disable_parallel_tool_use": True}
    served.fake.reply(Script(text=CALL))
    assert (await post(served, {**BODY, "max_tokens": 60, "tools": [WEATHER], "tool_choice": one})).status_code == 200
    assert '"array"' not in served.fake.requests[-1].params.grammar.value  # one call only
    assert "needs `tools`" in error(await post(served, {**BODY, "tool_choice": {"type": "any"}}), 400)
    named = {"type": "tool", "name": "nope"}
    assert "nope" in error(await post(served, {**BODY, "tools": [WEATHER], "tool_choice": named}), 400)


async def test_a_tool_result_round_trip(served):
    turns = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 degrees"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    served.fake.reply(Script(text='{"content":"Sunny, 18 degrees."}'))
    message = (await post(served, {**BODY, "max_tokens": 60, "messages": turns, "tools": [WEATHER]})).json()
    assert message["content"] == [{"type": "text", "text": "Sunny, 18 degrees."}]
    prompt = served.fake.requests[-1].prompt
    assert prompt.index('"city": "Paris"') < prompt.index("18 degrees") < prompt.index("And tomorrow?")
    failed = [
        *turns[:2],
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no network", "is_error": True}],
        },
    ]
    served.fake.reply(Script(text=" Sorry."))
    assert (await post(served, {**BODY, "messages": failed})).status_code == 200
    assert "Error: no network" in served.fake.requests[-1].prompt
    message = error(await post(served, {**BODY, "messages": turns[:2]}), 400)
    assert message.startswith("messages.1.content: the last message holds `tool_use` blocks")


# --- thinking --------------------------------------------------------------------------------------------------------


@functools.cache
def thinking_tokenizer():
    return build_thinking_tokenizer()


async def test_thinking_blocks_with_a_reasoning_parser():
    served = text_app(tokenizer=thinking_tokenizer(), reasoning_parser="qwen3", max_context=4096)
    served.fake.reply(Script(text="Let me think.</think>\n\nParis."))
    body = {**BODY, "max_tokens": 60, "thinking": {"type": "enabled", "budget_tokens": 30}}  # more than it thinks
    message = (await post(served, body)).json()
    assert message["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    served.fake.reply(Script(text="Let me think.</think>\n\nParis."))
    evs = events(await post(served, {**body, "stream": True}))
    assert next(e["delta"]["type"] for e in evs if e["type"] == "content_block_delta") == "thinking_delta"
    assert normal(streamed(evs))["content"] == message["content"]
    assert "budget_tokens" in error(await post(served, {**body, "max_tokens": 8}), 400)


async def test_thinking_needs_a_reasoning_parser(served):
    r = await post(served, {**BODY, "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert "reasoning_parser" in error(r, 400)
    served.fake.reply(Script(text=" Paris."))
    assert (await post(served, {**BODY, "thinking": {"type": "disabled"}})).status_code == 200


# --- refusals ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ({"top_p": 0}, "top_p: Input should be greater than 0"),
        ({"frequency_penalty": 1}, "frequency_penalty: Extra inputs are not permitted"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
        ({"stop_sequences": [" "]}, "stop_sequences: each stop sequence must contain non-whitespace"),
        ({"max_tokens": 5000}, "max_tokens: 5000 > "),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "prompt is too long: "),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            "messages.0.content.0.source.url: an image URL must be a data: URL or an http(s) URL",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]},
            "messages.0.content.0: `tool_use` blocks can only be in `assistant` messages",
        ),
        ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name: String should match"),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema: must be a JSON Schema"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice: Input tag 'sometimes'"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(served, change, expected):
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None}
    assert error(await post(served, body), 400).startswith(expected)


async def test_bodies_that_are_not_json_and_unknown_models(served):
    async with served.client() as http:
        r = await http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert "Failed to parse the request body as JSON" in error(r, 400)
        r = await http.post("/v1/messages", content=json.dumps(BODY), headers={"content-type": "text/plain"})
        assert "application/json" in error(r, 400)
    assert error(await post(served, {**BODY, "model": "claude-x"}), 404, "not_found_error") == "model: claude-x"
    small = text_app(payload_limit=100)
    assert error(await post(small, {**BODY, "system": "x" * 200}), 413, "request_too_large")


async def test_the_api_key_as_anthropic_clients_send_it():
    served = text_app(api_key="s3cret")
    served.fake.reply(Script(text=" Paris."))
    for headers in ({"x-api-key": "s3cret"}, {"authorization": "Bearer s3cret"}):
        r = await post(served, BODY, headers={**headers, "anthropic-version": "2023-06-01"})
        assert r.status_code == 200, (headers, r.text)
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "S3CRET"}, {"authorization": "Bearer wrong"}):
        assert error(await post(served, BODY, headers=headers), 401, "authentication_error") == "invalid x-api-key"
    counted = await post(
        served, {"model": "tiny", "messages": MESSAGES}, "/v1/messages/count_tokens", headers={"x-api-key": "s3cret"}
    )
    assert counted.status_code == 200
    async with served.client() as http:  # the other protocols' routes keep Authorization only
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES}, headers={"x-api-key": "s3cret"})
        assert r.status_code == 401


async def test_failures_before_and_after_the_stream_starts(served):
    served.fake.reply_once(Script(error=Overloaded("Worker queue capacity exceeded")))
    assert error(await post(served, BODY), 529, "overloaded_error") == "Overloaded"
    served.fake.reply(Script(text=" Paris is the capital.", failure="CUDA out of memory", failure_after=2))
    assert error(await post(served, BODY), 500, "api_error") == "CUDA out of memory"
    evs = events(await post(served, {**BODY, "stream": True}))
    assert [e["type"] for e in evs][:3] == ["message_start", "content_block_start", "ping"]
    assert evs[-1] == {"type": "error", "error": {"type": "api_error", "message": "CUDA out of memory"}}
    loading = text_app(status="pending")
    assert error(await post(loading, BODY), 503, "overloaded_error")
