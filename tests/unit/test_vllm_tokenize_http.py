"""vLLM's `/tokenize` and `/detokenize` beside TGI's `/tokenize`, and `/v1/models` with vLLM's fields, in
process over the fake text generator with the real tiny tokenizer (tests/helpers/text_app.py): exact
bodies, the body telling which protocol answers `/tokenize`, vLLM's error objects, the API key."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest

from helpers.tensor_app import affine_model
from helpers.text_app import text_app, tiny_tokenizer

KEY = "s3cret"


@pytest.fixture
def served():
    return text_app()


async def post(served, path: str, payload):
    async with served.client() as http:
        return await http.post(path, json=payload)


def error(message: str, status: int = 400, param: str | None = None) -> dict:
    """The OpenAI routes' error object (lmiserve/protocols/openai/errors.py)."""
    if status == 404:
        return {"error": {"message": message, "type": "not_found_error", "param": "model", "code": "model_not_found"}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


# --- /tokenize: the body tells which -------------------------------------------------------------------


async def test_inputs_is_tgi_byte_for_byte(served):
    r = await post(served, "/tokenize", {"inputs": "hi there"})
    assert r.status_code == 200
    assert r.content == (
        b'[{"id":1,"text":"","start":0,"stop":0},{"id":78,"text":"h","start":0,"stop":1},'
        b'{"id":79,"text":"i","start":1,"stop":2},{"id":446,"text":" there","start":2,"stop":8}]'
    )
    # a body with inputs stays TGI's even with vLLM's keys in it; one with neither is TGI's error
    r = await post(served, "/tokenize", {"inputs": "hi", "prompt": "x"})
    assert r.status_code == 200 and r.json()[0] == {"id": 1, "text": "", "start": 0, "stop": 0}
    r = await post(served, "/tokenize", {})
    assert (r.status_code, r.text) == (
        422,
        "Failed to deserialize the JSON body into the target type: inputs: Field required",
    )


async def test_prompt(served):
    r = await post(served, "/tokenize", {"prompt": "hi there"})
    assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
    assert r.content == b'{"count":4,"max_model_len":256,"tokens":[1,78,79,446],"token_strs":null}'
    assert r.json()["tokens"] == tiny_tokenizer()("hi there")["input_ids"]
    body = {"model": "tiny", "prompt": "hi there", "add_special_tokens": False, "return_token_strs": True}
    r = await post(served, "/tokenize", body)
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [78, 79, 446], "token_strs": ["h", "i", "Ġthere"]}
    r = await post(served, "/tokenize", {"model": None, "prompt": ""})
    assert r.json() == {"count": 1, "max_model_len": 256, "tokens": [1], "token_strs": None}


async def test_messages(served):
    chat = [{"role": "user", "content": "hi"}]
    r = await post(served, "/tokenize", {"messages": chat})  # <|user|>hi</s><|assistant|>, no BOS
    assert r.content == b'{"count":5,"max_model_len":256,"tokens":[5,78,79,2,6],"token_strs":null}'
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    r = await post(served, "/tokenize", {"messages": parts, "add_generation_prompt": False})
    assert r.json()["tokens"] == [5, 78, 79, 2]
    body = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    r = await post(served, "/tokenize", body)
    assert r.json()["tokens"] == [5, 78, 79]  # the last message left open
    r = await post(served, "/tokenize", {"messages": chat, "add_special_tokens": True, "return_token_strs": True})
    assert r.json()["tokens"] == [1, 5, 78, 79, 2, 6]
    assert r.json()["token_strs"] == ["<s>", "<|user|>", "h", "i", "</s>", "<|assistant|>"]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": "x", "messages": []}, 400, "Give either `prompt` or `messages`, not both."),
        ({"model": "nope", "prompt": "x"}, 404, "The model `nope` does not exist."),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "The model `nope` does not exist."),
        ({"prompt": 3}, 400, "prompt: Input should be a valid string"),
        ({"prompt": "x", "foo": 1}, 400, "foo: unknown field"),
        ({"messages": []}, 400, "messages: List should have at least 1 item after validation, not 0"),
        ({"messages": [{"content": "x"}]}, 400, "messages.0.role: a string is required"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0].image_url: an image URL (a non-empty string) is required",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            400,
            "messages: content parts must be {'type': 'text', 'text': str} or {'type': 'image_url', ...}",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True, "tools": []}},
            400,
            "chat_template_kwargs may not set tokenize, tools: give them as fields, if at all.",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            400,
            "`chat_template` is not accepted: the model's own chat template applies.",
        ),
    ],
)
async def test_tokenize_errors_are_the_openai_routes_error_object(served, body, status, message):
    field = re.match(r"^`(\w+)`", message)  # a message that starts with its field names it as `param`
    expected = error(message, status, field.group(1) if field else None)
    r = await post(served, "/tokenize", body)
    assert (r.status_code, r.headers["content-type"], r.json()) == (status, "application/json", expected)
    assert r.content == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()


async def test_chat_template_kwargs_and_tools_reach_the_template(served):
    tokenizer = copy.deepcopy(tiny_tokenizer())  # the shared one keeps its own template
    tokenizer.chat_template = "{% if think %}<|system|>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}ab{% endif %}"
    served.service._llm = dataclasses.replace(served.service._llm, tokenizer=tokenizer)
    chat = [{"role": "user", "content": "hi"}]
    plain = (await post(served, "/tokenize", {"messages": chat})).json()["tokens"]
    body = {"messages": chat, "chat_template_kwargs": {"think": True}, "tools": [{"type": "function"}]}
    both = (await post(served, "/tokenize", body)).json()["tokens"]
    assert plain == tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert both == tokenizer("<|system|>hiab", add_special_tokens=False)["input_ids"] != plain


async def test_a_model_that_does_not_generate_text():
    served = text_app(others={"affine": affine_model()})
    r = await post(served, "/tokenize", {"model": "affine", "prompt": "x"})
    assert r.json() == error("The model `affine` is a torchscript model: it does not generate text.")
    r = await post(served, "/detokenize", {"model": "affine", "tokens": [1]})
    assert r.status_code == 400


# --- /detokenize -----------------------------------------------------------------------------------------


async def test_detokenize(served):
    ids = tiny_tokenizer()("hi there")["input_ids"]
    r = await post(served, "/detokenize", {"tokens": ids})
    assert (r.status_code, r.content) == (200, b'{"prompt":"<s>hi there"}')  # special tokens kept, as vLLM
    r = await post(served, "/detokenize", {"model": "tiny", "tokens": []})
    assert r.content == b'{"prompt":""}'
    r = await post(served, "/detokenize", {"tokens": tiny_tokenizer()("café", add_special_tokens=False)["input_ids"]})
    assert r.json() == {"prompt": "café"}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"tokens": [1, 99999, -1]}, 400, "Token ids out of the vocabulary (0 to 511): [99999, -1]"),
        ({"tokens": [True]}, 400, "tokens.0: Input should be a valid integer"),
        ({"tokens": ["1"]}, 400, "tokens.0: Input should be a valid integer"),
        ({}, 400, "tokens: Field required"),
        ({"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens: unknown field"),
        ({"model": "nope", "tokens": [1]}, 404, "The model `nope` does not exist."),
    ],
)
async def test_detokenize_errors(served, body, status, message):
    r = await post(served, "/detokenize", body)
    assert (r.status_code, r.json()) == (status, error(message, status))


async def test_detokenize_needs_json(served):
    async with served.client() as http:
        r = await http.post("/detokenize", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "Failed to parse the request body as JSON"
        )
        r = await http.post("/detokenize", content=json.dumps({"tokens": [1]}))  # no Content-Type
        assert r.json() == error("Expected request with `Content-Type: application/json`")


# --- the API key ---------------------------------------------------------------------------------------------


async def test_tokenize_and_detokenize_need_the_key():
    served = text_app(api_key=KEY)
    async with served.client() as http:
        r = await http.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 401  # before the body is read: TGI's route answers it
        r = await http.post("/detokenize", json={"tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await http.post("/tokenize", json={"prompt": "hi"}, headers=auth)).json()["count"] == 3
        assert (await http.post("/detokenize", json={"tokens": [78]}, headers=auth)).json() == {"prompt": "h"}


# --- /v1/models ----------------------------------------------------------------------------------------------


async def test_models_list_every_text_model_with_max_model_len():
    served = text_app(max_total_tokens=128, others={"affine": affine_model()})
    async with served.client() as http:
        r = await http.get("/v1/models")
    assert r.content == (
        b'{"object":"list","data":[{"id":"tiny","object":"model","created":0,"owned_by":"tiny",'
        b'"root":"tiny","parent":null,"max_model_len":128}]}'
    )
    served = text_app(status="PENDING")
    async with served.client() as http:
        r = await http.get("/v1/models")
    assert r.json()["data"][0]["max_model_len"] is None  # not known while it loads
