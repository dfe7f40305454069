"""Tool calls in the model's own format, on a real server: the bundled SmolLM2 served with a Hermes-style
chat template (tests/helpers/chat_templates/hermes.jinja: Hermes 2 Pro's `<tool_call>` format, results in a
``tool`` turn), so `tool_call_parser=auto` picks ``hermes`` from the template; driven by the real `openai`
and `anthropic` clients and LangChain's `bind_tools`.

- ``auto`` with a greeting answers in text (no grammar pushes the model into a call);
- ``auto`` with a weather question, in an agent's conversation where two earlier questions were answered
  by calls (a 135M model does not call unprompted): the model writes ``<tool_call>`` itself, unconstrained,
  and it is parsed;
- ``required`` and a named function always give a valid call, generated in the Hermes syntax;
- a follow-up turn with the tool's result is templated the Hermes way (``<tool_response>``);
- ``none`` calls nothing and hides nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from helpers.client_venvs import LANGCHAIN_STAMP, missing

pytestmark = pytest.mark.e2e

HERMES = Path(__file__).resolve().parents[1] / "helpers" / "chat_templates" / "hermes.jinja"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a given city",
            "parameters": WEATHER_PARAMETERS,
        },
    }
]


def earlier_turn(city: str, temperature: int, call_id: str) -> list[dict]:
    """A question the assistant answered by calling the tool, its result, and the answer."""
    arguments = json.dumps({"location": city, "unit": "celsius"})
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "user", "content": f"What is the weather like in {city} today?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": temperature})},
        {"role": "assistant", "content": f"It is {temperature} degrees celsius in {city}."},
    ]


HISTORY = earlier_turn("London", 15, "call_1") + earlier_turn("Berlin", 12, "call_2")
WEATHER = [*HISTORY, {"role": "user", "content": "What is the weather like in Paris today?"}]
GREETING = [*HISTORY, {"role": "user", "content": "Hello, how are you?"}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}  # anthropic 2.x takes no `temperature` argument: sent in the body


@pytest.fixture(scope="module")
def url(server_pool, smollm_dir) -> str:
    return server_pool.url(["--chat-template", str(HERMES)], timeout=300)


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0) as c:
        yield c


def test_the_parser_is_picked_from_the_template(url):
    assert httpx.get(f"{url}/info", timeout=30).json()["tool_call_parser"] == "hermes"


def test_auto_with_a_greeting_answers_in_text(client):
    choice = client.chat.completions.create(
        model="smollm", messages=GREETING, tools=TOOLS, max_tokens=40, temperature=0
    ).choices[0]
    assert not choice.message.tool_calls and choice.message.content
    assert "<tool_call>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_with_a_weather_question_parses_the_models_own_call(client):
    choice = client.chat.completions.create(
        model="smollm", messages=WEATHER, tools=TOOLS, max_tokens=60, temperature=0
    ).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["location"].lower()
    assert choice.finish_reason == "tool_calls"

    stream = client.chat.completions.create(
        model="smollm", messages=WEATHER, tools=TOOLS, max_tokens=60, temperature=0, stream=True
    )
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    pieces = [d for c in deltas for d in (c.delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(c.delta.content or "" for c in deltas).strip()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_always_give_a_valid_call(client, tool_choice):
    for messages in (QUESTION, GREETING):
        choice = client.chat.completions.create(
            model="smollm", messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0
        ).choices[0]
        calls = choice.message.tool_calls
        assert calls and len(calls) <= (1 if isinstance(tool_choice, dict) else 8)  # a named tool: one call
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
        assert choice.finish_reason == "tool_calls"


def test_none_calls_nothing(client):
    choice = client.chat.completions.create(
        model="smollm", messages=WEATHER, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    ).choices[0]
    assert choice.message.tool_calls is None and choice.message.content is not None
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_result_is_templated_the_hermes_way(url, client):
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    body = {"model": "smollm", "messages": messages, "tools": TOOLS}
    templated = httpx.post(f"{url}/chat_tokenize", json=body, timeout=60).json()["templated_text"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>' in templated
    assert '<|im_start|>tool\n<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in templated
    answer = client.chat.completions.create(
        model="smollm", messages=messages, tools=TOOLS, max_tokens=30, temperature=0
    )
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def anthropic_history() -> list[dict]:
    """`HISTORY` in Anthropic's shape: ``tool_use`` blocks and ``tool_result`` blocks."""
    out: list[dict] = []
    for message in HISTORY:
        if message["role"] == "assistant" and message.get("tool_calls"):
            [call] = message["tool_calls"]
            use = {"type": "tool_use", "id": call["id"], "name": "get_weather"}
            out.append({"role": "assistant", "content": [{**use, "input": json.loads(call["function"]["arguments"])}]})
        elif message["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            out.append({"role": "user", "content": [result]})
        else:
            out.append(message)
    return out


def test_anthropic_tool_use_from_the_same_parse(url):
    tool = {"name": "get_weather", "description": "Get the current weather in a given city"}
    tool["input_schema"] = WEATHER_PARAMETERS
    weather = [*anthropic_history(), WEATHER[-1]]
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120) as c:
        message = c.messages.create(model="smollm", max_tokens=60, messages=weather, tools=[tool], extra_body=GREEDY)
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.id.startswith("toolu_") and "paris" in use.input["location"].lower()
        assert message.stop_reason == "tool_use"
        with c.messages.stream(model="smollm", max_tokens=60, messages=weather, tools=[tool], extra_body=GREEDY) as s:
            streamed = s.get_final_message()
        assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
        greeting = [*anthropic_history(), GREETING[-1]]
        answer = c.messages.create(model="smollm", max_tokens=40, messages=greeting, tools=[tool], extra_body=GREEDY)
        assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
        forced = c.messages.create(
            model="smollm",
            max_tokens=80,
            messages=QUESTION,
            tools=[tool],
            tool_choice={"type": "any"},
            extra_body=GREEDY,
        )
        uses = [b for b in forced.content if b.type == "tool_use"]
        assert uses and forced.stop_reason == "tool_use"
        for use in uses:
            jsonschema.validate(use.input, WEATHER_PARAMETERS)


def test_langchain_bind_tools(url):
    try:
        import langchain_openai
    except ImportError:
        missing(LANGCHAIN_STAMP, "install-langchain")  # fails under `make test`, which installs it
        raise
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    history: list = []
    for message in HISTORY:
        if message["role"] == "user":
            history.append(HumanMessage(message["content"]))
        elif message.get("tool_calls"):
            [call] = message["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            history.append(AIMessage("", tool_calls=[{"name": "get_weather", "args": args, "id": call["id"]}]))
        elif message["role"] == "tool":
            history.append(ToolMessage(message["content"], tool_call_id=message["tool_call_id"]))
        else:
            history.append(AIMessage(message["content"]))
    model = langchain_openai.ChatOpenAI(
        base_url=f"{url}/v1", api_key="none", model="smollm", temperature=0, max_tokens=60, max_retries=0
    )
    message = model.bind_tools(TOOLS).invoke([*history, HumanMessage(WEATHER[-1]["content"])])
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"] and "paris" in call["args"]["location"].lower()
    assert message.response_metadata["finish_reason"] == "tool_calls"
    greeting = model.bind_tools(TOOLS).invoke([*history, HumanMessage(GREETING[-1]["content"])])
    assert not greeting.tool_calls and greeting.content
    forced = model.bind_tools(TOOLS, tool_choice="required").invoke("Hello, how are you?")
    assert forced.tool_calls and {c["name"] for c in forced.tool_calls} == {"get_weather"}
