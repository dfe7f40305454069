"""Reasoning models on the OpenAI chat route (lmiserve.protocols.openai.reasoning): the splitter on its
own (every split of the markers across tokens, a block never closed, no block), then over HTTP on the
scripted fake with the tiny thinking tokenizer (its template opens ``<think>``): message and delta
fields, ``reasoning_tokens``, `chat_template_kwargs` / `reasoning_effort` reaching the template, a
grammar that starts after the block, tool calls after thinking, and the `openai` SDK reading it all.

The same on a real server: tests/integration/test_openai_reasoning.py."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest

from helpers.text_app import Script, text_app
from helpers.tiny_model import build_thinking_tokenizer
from lmiserve.protocols.openai.reasoning import Markers, Reasoning, opened_in

THINK = Markers("<think>", "</think>")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


# --- the splitter -------------------------------------------------------------------------------------------------


def split_in_two(reasoning: Reasoning, text: str, at: int) -> tuple[str, str]:
    splitter = reasoning.splitter()
    pieces = [splitter.token(text[:at]), splitter.token(text[at:]), splitter.flush()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


@pytest.mark.parametrize(
    ("inside", "text", "expected"),
    [
        (True, "Let me see.</think>\n\nParis.", ("Let me see.", "Paris.")),
        (False, "  <think>Let me see.</think>Paris.", ("Let me see.", "Paris.")),
        (True, "thinking and thinking", ("thinking and thinking", "")),  # never closed
        (False, "Paris. <think>not a block</think>", ("", "Paris. <think>not a block</think>")),  # no block
        (False, "<thi", ("", "<thi")),  # an unfinished start marker that never became one
        (True, "a</thi", ("a</thi", "")),
    ],
)
def test_every_split_point(inside, text, expected):
    reasoning = Reasoning(THINK, inside)
    for at in range(len(text) + 1):
        assert split_in_two(reasoning, text, at) == expected, at


def test_whole_split_and_token_count():
    inside = Reasoning(THINK, True)
    assert inside.split("a</think>\nb") == ("a", "b")
    assert inside.split("all thinking") == ("all thinking", None)  # content null
    assert inside.split("a</think>  ") == ("a", None)
    outside = Reasoning(THINK, False)
    assert outside.split("just the answer") == (None, "just the answer")
    assert outside.split("<think>a</think>b") == ("a", "b")
    assert inside.tokens(["I", " think", "</", "think>", "\n\n", "Paris"]) == 4  # up to the end marker's last piece
    assert outside.tokens(["<think>", "I", "</think>", "Paris"]) == 2
    assert outside.tokens(["Paris", "</think>"]) == 0


def test_where_the_block_starts():
    assert opened_in("<|assistant|><think>\n", THINK)
    assert not opened_in("<|assistant|><think>\n\n</think>\n\n", THINK)  # enable_thinking: false
    assert not opened_in("<|assistant|>", THINK)
    assert opened_in("<|assistant|>", Markers("", "</think>"))  # only an end marker: always inside


# --- over HTTP on the fake --------------------------------------------------------------------------------------


@functools.cache
def thinking_tokenizer():
    return build_thinking_tokenizer()


@pytest.fixture
def served():
    return text_app(tokenizer=thinking_tokenizer(), reasoning_parser="qwen3", max_context=4096)


async def post(served, body: dict) -> httpx.Response:
    async with served.client() as http:
        return await http.post("/v1/chat/completions", json=body)


def events(r: httpx.Response) -> list[dict]:
    parts = r.text.split("\n\n")
    assert parts[-2:] == ["data: [DONE]", ""], r.text
    return [json.loads(p.removeprefix("data: ")) for p in parts[:-2]]


def joined(chunks: list[dict], field: str) -> str | None:
    pieces = [c["choices"][0]["delta"].get(field) for c in chunks if c["choices"]]
    given = [p for p in pieces if p is not None]
    return "".join(given) if given else None


def count(text: str) -> int:
    return len(thinking_tokenizer()(text, add_special_tokens=False)["input_ids"])


async def test_whole_answer(served):
    served.fake.reply(Script(text="Let me think.</think>\n\nParis."))
    r = await post(served, {"messages": MESSAGES, "max_tokens": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "Let me think.",
        "reasoning": "Let me think.",
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": count("Let me think.</think>")}
    assert served.fake.requests[-1].prompt.endswith("<|assistant|><think>\n")


async def test_stream_with_a_marker_split_across_tokens(served):
    tokenizer = thinking_tokenizer()
    pieces = ["Let me think.", "</th", "ink>", "\n\n", "Paris."]
    ids = [i for piece in pieces for i in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    served.fake.reply(Script(ids=ids))
    r = await post(
        served, {"messages": MESSAGES, "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = events(r)
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == "Let me think."
    assert joined(chunks, "content") == "Paris."
    assert all("</" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": count("Let me think.</th") + count("ink>")}
    whole = (await post(served, {"messages": MESSAGES, "max_tokens": 50})).json()
    assert whole["choices"][0]["message"]["reasoning_content"] == "Let me think."
    assert whole["usage"] == usage


async def test_a_block_never_closed_is_all_reasoning(served):
    served.fake.reply(Script(text=" thinking and thinking and thinking", eos=False))
    first = thinking_tokenizer().decode(served.fake.ids(" thinking and thinking and thinking")[:3])
    body = (await post(served, {"messages": MESSAGES, "max_tokens": 3})).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == first
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    chunks = events(await post(served, {"messages": MESSAGES, "max_tokens": 3, "stream": True}))
    assert joined(chunks, "reasoning_content") == first and joined(chunks, "content") is None


async def test_template_kwargs_turn_thinking_off(served):
    served.fake.reply(Script(text="Paris."))
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    message = (await post(served, body)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None, "reasoning": None}
    prompt = served.fake.requests[-1].prompt
    assert prompt.startswith("<|system|>Reasoning effort: low</s>")
    assert prompt.endswith("<|assistant|><think>\n\n</think>\n\n")
    r = await post(served, {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and "chat_template_kwargs may not set tokenize" in r.json()["error"]["message"]
    r = await post(served, {"messages": MESSAGES, "reasoning_effort": "extreme"})
    assert r.status_code == 400


async def test_without_a_parser_the_block_stays_in_the_content():
    plain = text_app(tokenizer=thinking_tokenizer())
    plain.fake.reply(Script(text="Hmm.</think>Paris."))
    body = (await post(plain, {"messages": MESSAGES})).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hmm.</think>Paris."}
    assert "completion_tokens_details" not in body["usage"]


async def test_explicit_markers():
    custom = text_app(tokenizer=thinking_tokenizer(), reasoning_start="[[", reasoning_end="]]")
    custom.fake.reply(Script(text="[[plan]] done"))
    message = (await post(custom, {"messages": MESSAGES})).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "plan" and message["content"] == "done"
    end_only = text_app(tokenizer=thinking_tokenizer(), reasoning_end="]]")  # the output starts in the reasoning
    end_only.fake.reply(Script(text="plan]] done"))
    message = (await post(end_only, {"messages": MESSAGES})).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "plan" and message["content"] == "done"


async def test_a_grammar_starts_after_the_reasoning(served):
    answer = '{"city":"Paris"}'
    served.fake.reply(Script(text=f"Which city? France's capital.</think>\n{answer}", eos=False))
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = await post(served, {"messages": MESSAGES, "max_tokens": 100, "response_format": response_format})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == answer and choice["finish_reason"] == "stop", r.text
    assert choice["message"]["reasoning_content"] == "Which city? France's capital."
    assert served.fake.requests[-1].params.grammar.after == "</think>"
    # thinking off (the prompt closes the block): the grammar applies from the first token
    served.fake.reply(Script(text=answer, eos=False))
    body = {
        "messages": MESSAGES,
        "response_format": response_format,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    message = (await post(served, body)).json()["choices"][0]["message"]
    assert message["content"] == answer and message["reasoning_content"] is None
    assert served.fake.requests[-1].params.grammar.after == ""


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_tool_calls_after_thinking(served):
    call = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    served.fake.reply(Script(text=f"I need the weather.</think>{call}", eos=False))
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 100}
    message = (await post(served, body)).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    chunks = events(await post(served, {**body, "stream": True}))
    assert joined(chunks, "reasoning_content") == "I need the weather."
    calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_openai_sdk_reads_the_reasoning(served):
    served.fake.reply(Script(text="Let me think.</think>Paris."))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0)
    completion = await client.chat.completions.create(model="tiny", messages=MESSAGES, reasoning_effort="high")
    message = completion.choices[0].message
    assert message.content == "Paris." and message.model_extra["reasoning_content"] == "Let me think."
    assert completion.usage.completion_tokens_details.reasoning_tokens == count("Let me think.</think>")
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    reasoning, content, usage = "", "", None
    async for chunk in stream:
        if chunk.choices:
            reasoning += chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == ("Let me think.", "Paris.")
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == count("Let me think.</think>")
