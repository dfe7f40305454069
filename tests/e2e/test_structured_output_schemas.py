"""Structured output on the real bundled SmolLM2 behind a real server, over HTTP, all requests at
once (one rolling batch): 24 varied JSON schemas on the OpenAI chat route, greedy and seeded; regexes
on TGI's /generate; tool calls (required and named) on the chat route. Every output parses and
validates (`jsonschema`, formats checked), every regex output full-matches, every tool call's
arguments validate against its tool's schema. Schema features the library does not implement are
refused with a 4xx before anything is generated; the `openai` client's `chat.completions.parse`
turns the answer into a pydantic model.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from helpers.server import run_server

pytestmark = pytest.mark.e2e

MAX_TOKENS = 120
SEEDS = (None, 7)  # greedy, then do_sample with this seed
# Every string has a maxLength, every number bounds and a multipleOf: a sampled 135M model otherwise
# may write characters or fraction digits until max_tokens (valid so far, but not finished).


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 16}
SMALL_INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum_array": obj(
        {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}}
    ),
    "pattern_and_optional": obj(
        {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.1},
            "note": {"type": "string", "maxLength": 20},
        },
        required=["city", "temperature"],
    ),
    "nested": obj(
        {
            "book": obj(
                {
                    "title": {"type": "string", "maxLength": 30},
                    "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                }
            )
        }
    ),
    "exclusive_bounds": obj(
        {"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.001}}
    ),
    "bounded_integers": obj(
        {
            "count": {"type": "integer", "minimum": 1, "maximum": 10},
            "offset": {"type": "integer", "minimum": -100, "maximum": -1},
        }
    ),
    "const": obj(
        {"version": {"const": 2}, "kind": {"const": "point"}, "x": {"type": "integer", "minimum": -100, "maximum": 100}}
    ),
    "nullable": obj(
        {
            "middle_name": {"type": ["string", "null"], "maxLength": 10},
            "nickname": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        }
    ),
    "any_of": obj(
        {
            "id": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "pattern": "^[a-z]{3}$"},
                ]
            }
        }
    ),
    "one_of": obj(
        {
            "shape": {
                "oneOf": [
                    obj(
                        {
                            "kind": {"const": "circle"},
                            "radius": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01},
                        }
                    ),
                    obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}}),
                ]
            }
        }
    ),
    "formats": obj(
        {
            "id": {"type": "string", "format": "uuid"},
            "email": {"type": "string", "format": "email", "maxLength": 30},
            "day": {"type": "string", "format": "date"},
        }
    ),
    "array_of_objects": obj(
        {
            "items": {
                "type": "array",
                "items": obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    }
                ),
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "booleans": obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}),
    "enums": obj({"size": {"enum": ["S", "M", "L"]}, "level": {"enum": [1, 2, 3]}}),
    "all_optional": obj({"title": {"type": "string", "maxLength": 20}, "done": {"type": "boolean"}}, required=[]),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 0, "maximum": 9}})})})}),
    "matrix": obj(
        {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    "tuple": obj(
        {
            "entry": {
                "type": "array",
                "prefixItems": [{"type": "string", "maxLength": 10}, SMALL_INT, {"type": "boolean"}],
                "items": False,
                "minItems": 3,
            }
        }
    ),
    "refs": {
        "$defs": {
            "address": obj(
                {"street": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
            )
        },
        **obj({"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}}),
    },
    "string_lengths": obj({"code": {"type": "string", "minLength": 4, "maxLength": 4, "pattern": "^[A-Z0-9]+$"}}),
    "coordinates": obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.01},
            "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.01},
        }
    ),
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 3,
        "maxItems": 5,
    },
    "all_of": {"allOf": [obj({"name": NAME, "id": SMALL_INT}), {"required": ["name", "id"]}]},
    "multiple_of": obj({"even": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 100}}),
}

REGEXES = [
    r"[0-9]{3}-[0-9]{3}-[0-9]{4}",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
    r"(yes|no|maybe)",
    r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)",
]
REGEX_PROMPTS = ["My phone number is ", "The meeting is on ", "Will it rain? Answer: ", "Write to me at "]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": obj(
                {"location": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}}
            ),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "description": "Add two integers",
            "parameters": obj({"a": SMALL_INT, "b": SMALL_INT}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_event",
            "description": "Put an event in the calendar",
            "parameters": obj(
                {
                    "title": {"type": "string", "maxLength": 30},
                    "date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"},
                    "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
                    "all_day": {"type": "boolean"},
                },
                required=["title", "date"],
            ),
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_QUESTIONS = ["What is the weather in Paris?", "What is 12 plus 30?", "Plan a team lunch next Friday."]

# What llguidance does not implement (refused at compile time, before any token): see docs/structured-output.md, "JSON Schema coverage".
UNSUPPORTED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "if": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "not": {"not": {"type": "string"}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "Unknown format": {"type": "string", "format": "color"},
    "look-around": {"type": "string", "pattern": "^(?=a)a+$"},
    "backreferences": {"type": "string", "pattern": "^(a)\\1$"},
    "not present in a registry": {"$ref": "https://example.com/schema.json"},
}


def _decimal_multiple_of(validator, divisor, instance, schema):
    """`multipleOf` in decimal: jsonschema's float division says 40.52 is no multiple of 0.01."""
    if validator.is_type(instance, "number") and Decimal(str(instance)) % Decimal(str(divisor)) != 0:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")


Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _decimal_multiple_of})


def validate(instance: Any, schema: dict[str, Any]) -> None:
    Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(instance)


@pytest.fixture(scope="module")
def url(smollm_dir) -> Iterator[str]:
    with run_server(["-o", "max_rolling_batch_size=64"], timeout=300) as base:
        yield base


def sampling(seed: int | None) -> dict[str, Any]:
    return {"temperature": 0} if seed is None else {"temperature": 0.8, "seed": seed}


def schema_request(name: str, schema: dict[str, Any], seed: int | None) -> tuple[str, dict[str, Any]]:
    prompt = f"Answer with a JSON value ({name.replace('_', ' ')}): invent an example."
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **sampling(seed),
    }
    return "/v1/chat/completions", body


def regex_request(pattern: str, prompt: str, seed: int | None) -> tuple[str, dict[str, Any]]:
    params: dict[str, Any] = {"max_new_tokens": 40, "grammar": {"type": "regex", "value": pattern}}
    if seed is not None:
        params |= {"do_sample": True, "seed": seed, "temperature": 0.8}
    return "/generate", {"inputs": prompt, "parameters": params}


def tool_request(question: str, tool: str, choice: str, seed: int | None) -> tuple[str, dict[str, Any]]:
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": tool}}
    body = {
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": MAX_TOKENS,
        **sampling(seed),
    }
    return "/v1/chat/completions", body


async def post_all(base: str, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(client.post(path, json=body) for path, body in requests)))


def test_outputs_validate_regexes_match_tool_calls_validate(url):
    """Everything at once, one rolling batch: 48 schema requests, 8 regex requests, 12 tool requests."""
    schema_jobs = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    regex_jobs = [(pattern, prompt, seed) for pattern, prompt in zip(REGEXES, REGEX_PROMPTS) for seed in SEEDS]
    tool_jobs = [
        (question, tool, choice, seed)
        for question, tool in zip(TOOL_QUESTIONS, TOOL_SCHEMAS)
        for choice in ("required", "named")
        for seed in SEEDS
    ]
    requests = [schema_request(name, SCHEMAS[name], seed) for name, seed in schema_jobs]
    requests += [regex_request(*job) for job in regex_jobs]
    requests += [tool_request(*job) for job in tool_jobs]
    responses = iter(asyncio.run(post_all(url, requests)))

    failures: list[str] = []  # all of them at once: one run of this batch is minutes on a busy machine
    for name, seed in schema_jobs:
        response = next(responses)
        try:
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            content = choice["message"]["content"]
            assert choice["finish_reason"] == "stop", content  # every one finished
            validate(json.loads(content), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"schema {name} seed {seed}: {str(exc)[:300]}")

    for pattern, _, seed in regex_jobs:
        response = next(responses)
        text = response.json().get("generated_text") if response.status_code == 200 else response.text
        if not re.fullmatch(pattern, str(text)):
            failures.append(f"regex {pattern} seed {seed}: {text!r}")

    for _, tool, choice, seed in tool_jobs:
        response = next(responses)
        try:
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]
            assert answer["finish_reason"] == "tool_calls", answer
            calls = answer["message"]["tool_calls"]
            assert calls and answer["message"]["content"] is None, answer
            for call in calls:
                assert call["function"]["name"] in TOOL_SCHEMAS, call
                arguments = json.loads(call["function"]["arguments"])
                validate(arguments, TOOL_SCHEMAS[call["function"]["name"]])
            if choice == "named":
                assert {call["function"]["name"] for call in calls} == {tool}, calls
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"tool {tool} ({choice}) seed {seed}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("feature", list(UNSUPPORTED))
def test_unsupported_schema_features_are_refused_before_generating(url, feature):
    schema = UNSUPPORTED[feature]
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
        timeout=120,
    )
    assert chat.status_code == 400 and feature in chat.json()["error"]["message"], chat.text  # OpenAI's 400
    tgi = httpx.post(
        f"{url}/generate",
        json={"inputs": "hi", "parameters": {"max_new_tokens": 5, "grammar": {"type": "json", "value": schema}}},
        timeout=120,
    )
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation" and feature in tgi.json()["error"]


class Event(BaseModel):
    title: str = Field(max_length=30)
    attendees: list[str] = Field(max_length=3)
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    hours: int = Field(ge=1, le=8)


def test_openai_parse_with_a_pydantic_model(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300) as client:
        completion = client.chat.completions.parse(
            model="smollm",
            messages=[{"role": "user", "content": "Plan a team meeting as JSON."}],
            response_format=Event,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop" and message.refusal is None
    assert isinstance(message.parsed, Event) and 1 <= message.parsed.hours <= 8
    assert Event.model_validate_json(message.content) == message.parsed
