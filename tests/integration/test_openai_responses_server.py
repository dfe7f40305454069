"""OpenAI's Responses API on real `lmiserve serve` processes, driven by the real `openai` client,
unmodified: string and item input, `instructions`, `max_output_tokens` (incomplete), the typed stream
(event order, sequence numbers, the same text as the greedy whole answer), forced function calls whose
arguments validate against the tool's schema and their `function_call_output` round trip, a
`text.format` JSON schema, the store (`previous_response_id`, retrieve, delete), reasoning items under a
reasoning parser, and errors as the SDK's exception classes. The in-process tests of the same:
tests/unit/test_openai_responses_http.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from helpers.server_pool import ServerPool
from helpers.tiny_model import THINK_END

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
BUDGET = 120  # tokens: enough for any call of the tool or object of PLACE, whatever the tiny model picks


@pytest.fixture(scope="module")
def client(server_pool: ServerPool, long_model_dir: Path) -> Iterator[openai.OpenAI]:
    # the 4096-token copy of the tiny model (a tool prompt alone is ~300 tokens), answering to "tiny"
    url = server_pool.url(["--model-id", str(long_model_dir), "-o", "served_model_name=tiny"])
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_string_input_instructions_and_max_output_tokens(client):
    response = client.responses.create(
        model="tiny", input="What is deep learning?", instructions="Be brief.", max_output_tokens=5, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert response.output_text == message.content[0].text and response.output_text
    usage = response.usage
    assert usage.output_tokens == 5 and usage.total_tokens == usage.input_tokens + 5
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert (response.instructions, response.max_output_tokens, response.temperature) == ("Be brief.", 5, 0.0)


def test_item_input(client):
    items = [
        {"type": "message", "role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Another one?"},
    ]
    response = client.responses.create(model="tiny", input=items, max_output_tokens=4, temperature=0)
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    assert response.usage.input_tokens > 20  # every item reached the prompt


def test_the_stream_is_typed_ordered_and_ends_with_the_greedy_text(client):
    kwargs = {"model": "tiny", "input": "What is deep learning?", "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.id == events[0].response.id

    # the SDK's stream helper accumulates the same text (the random model rarely ends on its own: incomplete)
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=8, temperature=0) as stream:
        seen = list(stream)
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert seen[-1].type == "response.incomplete" and "".join(deltas) == seen[-1].response.output_text


def assert_valid_call(item) -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), WEATHER_PARAMETERS)


def test_a_forced_call_and_its_output_round_trip(client):
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice=forced,
        max_output_tokens=BUDGET,
        temperature=0,
    )
    [call] = response.output
    assert_valid_call(call)
    assert response.tools[0].name == "get_weather" and response.tool_choice.name == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}
    follow = client.responses.create(
        model="tiny", input=[result], previous_response_id=response.id, max_output_tokens=5, temperature=0
    )
    assert follow.previous_response_id == response.id and follow.output[0].type == "message"

    # without the store: the conversation given whole, the call item passed back as it came: the same prompt
    again = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(), result],
        store=False,
        max_output_tokens=5,
        temperature=0,
    )
    assert again.store is False and again.output[0].type == "message"
    assert again.usage.input_tokens == follow.usage.input_tokens and again.output_text == follow.output_text

    streamed = list(
        client.responses.create(
            model="tiny",
            input="Weather?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,  # one call, then the grammar ends the answer (no budget-bound second call)
            max_output_tokens=BUDGET,
            temperature=0,  # greedy: a sampled tiny model may spend the budget inside a call
            stream=True,
        )
    )
    done = [e for e in streamed if e.type == "response.output_item.done"]
    assert done and all(e.item.type == "function_call" for e in done) and streamed[-1].type == "response.completed"
    for event in done:
        assert_valid_call(event.item)
        deltas = "".join(
            e.delta
            for e in streamed
            if e.type == "response.function_call_arguments.delta" and e.item_id == event.item.id
        )
        assert deltas == event.item.arguments


def test_text_format_json_schema(client):
    response = client.responses.create(
        model="tiny",
        input="Where is it sunny?",
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}},
        max_output_tokens=BUDGET,
        temperature=0,
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), PLACE)
    assert response.text.format.type == "json_schema" and response.text.format.name == "place"


def test_store_retrieve_and_delete(client):
    first = client.responses.create(model="tiny", input="Name a fruit.", max_output_tokens=3, temperature=0)
    assert first.store is True
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(
        model="tiny", input="And a vegetable?", previous_response_id=first.id, max_output_tokens=3, temperature=0
    )
    alone = client.responses.create(model="tiny", input="And a vegetable?", max_output_tokens=3, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the first turn came first
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert (gone.value.code, gone.value.param) == ("previous_response_not_found", "previous_response_id")
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_errors_are_the_sdk_classes(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="gpt-4o", input="Hi")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as hosted:
        client.responses.create(model="tiny", input="Hi", tools=[{"type": "web_search"}])
    assert hosted.value.param == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as background:
        client.responses.create(model="tiny", input="Hi", background=True)
    assert background.value.param == "background"
    with pytest.raises(openai.BadRequestError) as long:
        client.responses.create(model="tiny", input="Hi", max_output_tokens=5000)
    assert long.value.code == "context_length_exceeded"


def test_reasoning_items(server_pool: ServerPool, thinking_model_dir: Path):
    url = server_pool.url(["--model-id", str(thinking_model_dir)], env={"OPTION_REASONING_PARSER": "qwen3"})
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        # the template opened the block and the random model never closes it: all reasoning, cut
        cut = client.responses.create(model="tiny-think", input="2+2?", max_output_tokens=8, temperature=0)
        [reasoning] = cut.output
        assert reasoning.type == "reasoning" and reasoning.status == "incomplete" and reasoning.content[0].text
        assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 8
        streamed = list(
            client.responses.create(model="tiny-think", input="2+2?", max_output_tokens=8, temperature=0, stream=True)
        )
        thought = "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta")
        assert thought == reasoning.content[0].text

        # `</think>` pushed first: the block closes at once (an empty block is no item), the rest is the answer
        from transformers import AutoTokenizer

        end_id = AutoTokenizer.from_pretrained(thinking_model_dir).convert_tokens_to_ids(THINK_END)
        both = client.responses.create(
            model="tiny-think",
            input="2+2?",
            max_output_tokens=6,
            temperature=0,
            extra_body={"logit_bias": {str(end_id): 100}},
        )
        assert [item.type for item in both.output] == ["message"] and both.output_text
        assert both.usage.output_tokens_details.reasoning_tokens == 1
