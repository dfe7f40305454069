"""Bad requests over real HTTP: HTTP 424 with ``{"error": ..., "code": 424}``
and LMI's messages; never a 500, never a hang; the server keeps answering normally afterwards."""

from __future__ import annotations

import json

import pytest

PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "
NOT_OBJECT = (
    "Invalid request payload. Request payload should be a json object specifying the 'inputs' field. Received payload "
)
NOT_STRING = "Invalid request payload. The 'inputs' field must be a string. Received type "
EMPTY = "Invalid request payload. The 'inputs' field does not contain any content. Received payload "
PARAMS = "Invalid request payload. 'parameters' must be provided as an object of key-value pairs. Received payload "

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # well over 64 tokens


def assert_424(response, message: str | None = None, *, contains: tuple[str, ...] = ()) -> str:
    assert response.status_code == 424, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.text)
    assert list(body) == ["error", "code"]  # error first
    assert body["code"] == 424
    assert isinstance(body["error"], str) and body["error"]
    if message is not None:
        assert body["error"] == message
    for part in contains:
        assert part in body["error"], (part, body["error"])
    return body["error"]


# --- payload validation, LMI's exact messages ------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], NOT_OBJECT + "[1, 2]"),
        ("just a string", NOT_OBJECT + "'just a string'"),
        ({"input": "hi"}, NOT_OBJECT + "{'input': 'hi'}"),  # a `prompt` body is an OpenAI completion
        ({"inputs": None}, NOT_OBJECT + "{'inputs': None}"),
        ({"inputs": ["a", "b"]}, NOT_STRING + "<class 'list'>"),
        ({"inputs": 5}, NOT_STRING + "<class 'int'>"),
        ({"inputs": ""}, EMPTY + "{'inputs': ''}"),
        ({"inputs": "hi", "parameters": [1]}, PARAMS + "{'inputs': 'hi', 'parameters': [1]}"),
        (
            {"inputs": "hi", "parameters": "max_new_tokens=3"},
            PARAMS + "{'inputs': 'hi', 'parameters': 'max_new_tokens=3'}",
        ),
    ],
    ids=[
        "list",
        "string",
        "missing-inputs",
        "null-inputs",
        "inputs-list",
        "inputs-int",
        "empty-inputs",
        "parameters-list",
        "parameters-string",
    ],
)
def test_payload_validation_messages(server, payload, message):
    assert_424(server.post(payload), PREFIX + message)


def test_streaming_request_fails_the_same_way(server):
    response = server.post({"inputs": "", "stream": True})
    assert_424(response, PREFIX + EMPTY + "{'inputs': '', 'stream': True}")


def test_invalid_json(server):
    response = server.post(content=b"hello", headers={"content-type": "application/json"})
    assert_424(response, PREFIX + "Expecting value: line 1 column 1 (char 0)")


def test_truncated_json(server):
    response = server.post(content=b'{"inputs": "hi"', headers={"content-type": "application/json"})
    assert_424(response, contains=(PREFIX,))


def test_text_plain_body_is_a_list_of_inputs(server):
    response = server.post(content=b"What is Deep Learning?", headers={"content-type": "text/plain"})
    assert_424(response, PREFIX + NOT_STRING + "<class 'list'>")


def test_empty_body_without_content_type(server):
    response = server.client.post("/invocations", content=b"", timeout=30)
    assert_424(response, PREFIX + EMPTY + "{'inputs': ''}")


def test_application_jsonlines_body_is_json(server):
    """Content-Type is matched by substring: application/jsonlines is decoded as JSON."""
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    response = server.post(content=body, headers={"content-type": "application/jsonlines"})
    assert response.status_code == 200, response.text


# --- parameter values --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "name"),
    [
        ({"temperature": -0.5, "do_sample": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_new_tokens": "many"}, "max_new_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_sequences": 5}, "stop_sequences"),
    ],
)
def test_invalid_parameter_values(server, parameters, name):
    assert_424(server.post({"inputs": "Hello", "parameters": parameters}), contains=(name,))


def test_n_greater_than_one_with_stream(server):
    response = server.post({"inputs": "Hello", "stream": True, "parameters": {"n": 2, "do_sample": True}})
    assert_424(response, contains=("n",))


def test_max_new_tokens_above_the_limit(server):
    assert_424(server.post({"inputs": "Hello", "parameters": {"max_new_tokens": 5000}}), contains=("4096", "5000"))


def test_unknown_parameter_is_ignored(server):
    response = server.post({"inputs": "Hello", "parameters": {"foo": 1, "max_new_tokens": 2}})
    assert response.status_code == 200, response.text
    assert list(response.json()) == ["generated_text"]


def test_null_parameters_are_no_parameters(server):
    response = server.post({"inputs": "Hello", "parameters": None})
    assert response.status_code == 200, response.text


# --- prompt length (max_input_len=64 on this server) ------------------------------------------------------


def prompt_tokens(tiny_model, text: str) -> int:
    return len(tiny_model.tokenizer(text)["input_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_max_input_len(server, tiny_model, stream):
    n = prompt_tokens(tiny_model, LONG_PROMPT)
    assert n > 64
    response = server.post({"inputs": LONG_PROMPT, "stream": stream, "parameters": {"max_new_tokens": 2}})
    assert 400 <= response.status_code < 500
    assert_424(response, f"Input prompt ({n} tokens) is too long and exceeds limit of 64")


def test_truncate_keeps_the_last_tokens(server):
    response = server.post(
        {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 3, "truncate": 32, "details": True}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] == 3


def test_prompt_plus_max_new_tokens_beyond_the_context(server):
    """The tiny model has a 256-token context."""
    response = server.post({"inputs": "Hello world", "parameters": {"max_new_tokens": 255}})
    assert_424(response, contains=("256",))


# --- afterwards ------------------------------------------------------------------------------------------


def test_server_still_healthy_after_bad_requests(server):
    assert server.get("/ping").status_code == 200
    response = server.post({"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}})
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] <= 4
    _, lines = server.stream("Hello", max_new_tokens=3)
    assert 1 <= len(lines) <= 3
