"""Structured output through a real server on the tiny model, with the real clients: `openai`
(`response_format`, vLLM's `guided_*` in `extra_body`), `text-generation` and
`huggingface_hub.InferenceClient` (`grammar`), and LMI `/invocations` (`json_schema`). Outputs are
validated with `jsonschema` / a regex full match."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import ValidationError
from text_generation.types import Grammar, GrammarType

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
REGEX = r"\+1 [0-9]{3}-[0-9]{4}"
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
NEW = 100


@pytest.fixture(scope="module")
def url(server_pool, tiny_model_dir) -> str:
    return server_pool.url(["--model-id", str(tiny_model_dir)])  # shared: the tiny model's defaults


@pytest.fixture
def client(url) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


# --- OpenAI ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_chat_response_format_json_schema(client, temperature):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=NEW,
        temperature=temperature,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_response_format_text_is_no_constraint_and_json_object_is_an_object(client):
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, response_format={"type": "text"}
    )
    assert plain.choices[0].finish_reason == "length"
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=NEW, temperature=0, response_format={"type": "json_object"}
    )
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the random model may write one endless key: cut mid-structure
        assert obj.choices[0].finish_reason == "length" and content.startswith("{")


def test_chat_stream_with_schema_sends_null_finish_reasons_until_the_last_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_guided_regex_and_choice_through_extra_body(client):
    regex = client.completions.create(
        model="tiny", prompt="Call me at", max_tokens=NEW, temperature=0, extra_body={"guided_regex": REGEX}
    )
    assert re.fullmatch(REGEX, regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model="tiny",
        prompt="Is it sunny?",
        max_tokens=NEW,
        temperature=0.8,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert choice.choices[0].text in ("sunny", "rainy")


def test_completions_stream_finish_reason_is_null_until_the_last_chunk(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt="a", max_tokens=6, temperature=0, stream=True, extra_body={"guided_json": SCHEMA}
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_max_tokens_mid_structure_gives_length_and_the_partial_text(client):
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        {"guided_regex": "(("},
        {"guided_regex": "a+", "guided_choice": ["b"]},
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        {"response_format": {"type": "yaml"}},
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_refused_before_anything_is_generated(url, extra, stream):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": stream, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text  # OpenAI's status and error object
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_on_a_bad_schema_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body={"guided_regex": "(("})
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


# --- TGI -------------------------------------------------------------------------------------------------


def test_text_generation_client_grammar_json_and_regex(url):
    tgi = Client(url, timeout=60)
    response = tgi.generate("A city:", max_new_tokens=NEW, grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    assert response.details.finish_reason.value == "eos_token"
    jsonschema.validate(json.loads(response.generated_text), SCHEMA)
    streamed = "".join(
        e.token.text
        for e in tgi.generate_stream("Phone:", max_new_tokens=NEW, grammar=Grammar(type=GrammarType.Regex, value=REGEX))
        if not e.token.special
    )
    assert re.fullmatch(REGEX, streamed)


def test_text_generation_client_bad_regex_is_a_validation_error(url):
    with pytest.raises(ValidationError):
        Client(url, timeout=60).generate("x", max_new_tokens=5, grammar=Grammar(type=GrammarType.Regex, value="(("))


def test_huggingface_hub_text_generation_grammar(url):
    hub = InferenceClient(url, timeout=60)
    text = hub.text_generation("A city:", max_new_tokens=NEW, grammar={"type": "json", "value": SCHEMA})
    jsonschema.validate(json.loads(text), SCHEMA)


def test_tgi_grammar_json_string_value_on_post_root(url):
    r = httpx.post(
        url,
        json={
            "inputs": "A city:",
            "parameters": {"max_new_tokens": NEW, "grammar": {"type": "json", "value": json.dumps(SCHEMA)}},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()[0]["generated_text"]), SCHEMA)


# --- LMI -------------------------------------------------------------------------------------------------


def test_lmi_invocations_json_schema_parameter(url):
    r = httpx.post(
        f"{url}/invocations",
        json={"inputs": "A city:", "parameters": {"max_new_tokens": NEW, "json_schema": SCHEMA}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)


def test_lmi_invocations_bad_schema_is_a_client_error(url):
    r = httpx.post(
        f"{url}/invocations",
        json={"inputs": "x", "parameters": {"max_new_tokens": 5, "json_schema": {"type": "nope"}}},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text
