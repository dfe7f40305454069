"""Tool calling with the bundled SmolLM2-135M-Instruct (whose chat template knows no tools: they
reach it through the system prompt) and the real `openai` client: a weather question gets a complete
call of the weather tool whose arguments validate against its schema, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

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
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(server_pool, smollm_dir):
    base = server_pool.url([], timeout=300)  # `make serve`'s server, shared with the other e2e modules
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120) as c:
        yield c


def test_weather_question_gets_a_valid_call(client):
    completion = client.chat.completions.create(
        model="smollm", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert "paris" in arguments["location"].lower()

    streamed = client.chat.completions.create(
        model="smollm",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    pieces = [d for chunk in streamed for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_auto_gives_text_or_a_valid_call(client):
    choice = client.chat.completions.create(
        model="smollm", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0
    ).choices[0]
    if choice.message.tool_calls:
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER_PARAMETERS)
    else:
        assert choice.message.content
