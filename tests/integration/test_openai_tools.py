"""Tool calling on /v1/chat/completions, driven by the real `openai` and `huggingface_hub` clients
against `lmiserve serve` on the tiny random model: whatever the model's weights, the answer is a
complete call whose arguments validate against the tool's schema (or, with ``auto``, plain text)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

from helpers.server import run_server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "details": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMETERS},
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
BUDGET = 120  # tokens: enough for any call of these tools, whatever the tiny model picks


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["celsius", "fahrenheit"] = Field(description="temperature unit")


@pytest.fixture(scope="module")
def url(long_model_dir) -> Iterator[str]:  # the tools' system prompt alone is ~300 tiny-model tokens
    # served as "tiny-long": "tiny", the name these tests send, is an alias (any other name is a 404)
    with run_server(["--model-id", str(long_model_dir), "-o", "served_model_name=tiny"]) as base:
        yield base


@pytest.fixture
def client(url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def assert_valid_calls(tool_calls) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_call_is_complete_and_valid(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=BUDGET,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_named_function_is_called(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=BUDGET,
        temperature=0,
        parallel_tool_calls=False,
    )
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_calls([call])


def test_auto_answers_text_or_valid_calls(client):
    for seed in range(4):
        choice = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=BUDGET, seed=seed
        ).choices[0]
        if choice.message.tool_calls:  # calls finished before max_tokens are listed, a cut one is not
            assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
            assert_valid_calls(choice.message.tool_calls)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_tool_choice_none_is_plain_text(client):
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0
    )
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    assert completion.choices[0].message.content == plain.choices[0].message.content
    assert completion.choices[0].message.tool_calls is None


def test_max_tokens_mid_call_returns_no_half_call(client):
    choice = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=3, temperature=0
    ).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content is None


def test_stream_matches_the_whole_answer(client):
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required"}
    whole = client.chat.completions.create(**kwargs, max_tokens=BUDGET, temperature=0).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=BUDGET, temperature=0, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.function.name:
                assert call["name"] is None and delta.id.startswith("call_")  # id and name once, first
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


def test_stream_helper_parses_strict_pydantic_tool(client):
    with client.chat.completions.stream(
        model="tiny",
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_tokens=BUDGET,
        temperature=0,
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.role == "assistant"
    parsed = choice.message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather)


def test_round_trip_call_result_answer(client):
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=BUDGET, temperature=0
    ).choices[0]
    call = first.message.tool_calls[0]
    conversation = [
        *MESSAGES,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model="tiny", messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    ).choices[0]
    assert isinstance(answer.message.content, str) and answer.finish_reason == "length"
    again = client.chat.completions.create(
        model="tiny", messages=conversation, tools=[WEATHER], max_tokens=BUDGET, temperature=0
    ).choices[0]
    if again.message.tool_calls:
        assert_valid_calls(again.message.tool_calls)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not found"),
        ({"tool_choice": "required"}, "needs `tools`"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object"),
        ({"tools": [{"type": "function"}]}, "`tools[0].function`"),
        ({"tools": ["get_weather"]}, "`tools[0]`"),
    ],
)
def test_bad_tools_are_400_tool_errors(client, url, fields, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **fields)
    body = info.value.response.json()["error"]
    assert body["message"].startswith("Tool error: ") and message in body["message"]
    streamed = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **fields}, timeout=30
    )  # answered before the stream starts
    assert streamed.status_code == 400 and streamed.json()["error"]["message"].startswith("Tool error: ")


def test_huggingface_hub_chat_completion_with_tools(url):
    client = InferenceClient(base_url=url)
    output = client.chat_completion(MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=BUDGET, seed=1)
    [choice] = output.choices
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = client.chat_completion(
        MESSAGES, tools=[WEATHER, TIME], tool_choice={"function": {"name": "get_weather"}}, max_tokens=BUDGET, seed=1
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    chunks = list(
        client.chat_completion(
            MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=BUDGET,
            temperature=0,
            stream=True,
            extra_body={"parallel_tool_calls": False},
        )
    )
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
            if delta.function.name:
                names[delta.index] = delta.function.name
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and arguments
    [(index, text)] = arguments.items()
    jsonschema.validate(json.loads(text), SCHEMAS[names[index]])


def test_chat_tokenize_shows_the_tools(url):
    body = httpx.post(f"{url}/chat_tokenize", json={"messages": MESSAGES, "tools": [WEATHER]}, timeout=30).json()
    assert '"name": "get_weather"' in body["templated_text"]
    assert body["templated_text"].endswith("<|user|>What is the weather in Paris?</s><|assistant|>")
