"""The OpenAI-compatible routes over HTTP, in process, on the scripted fake engine
(tests/helpers/text_app.py): /v1/chat/completions and /v1/completions, whole and streamed (SSE ending
in ``data: [DONE]``), usage and finish reasons, n, logprobs, echo, the errors (before the stream as
TGI's JSON, after it in-band), tool calls and structured output (the real grammar compiler checks the
scripted tokens), the /invocations dispatch of `messages` and `prompt` bodies, client disconnects, and
the golden files of tests/golden/openai replayed (their tokens scripted) through the whole HTTP path.

The same requests on a real server: tests/integration/test_openai_http.py, test_openai_tools.py,
test_structured_output.py."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import openai
import pytest

from helpers.tensor_app import client as tensor_client
from helpers.tensor_app import tensor_app, text_model
from helpers.text_app import Script, text_app
from lmiserve.config.sources import load_settings
from lmiserve.core.errors import InvalidRequest, ModelNotReady, Overloaded, QueueTimeout

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "openai"
MESSAGES = [{"role": "user", "content": "What is deep learning?"}]
CHAT_PROMPT_TOKENS = 10  # "<|user|>What is deep learning?</s><|assistant|>" with the tiny tokenizer
FOX = " the quick brown fox jumps"
DONE = b"data: [DONE]\n\n"
_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}"')
_CALL_ID = re.compile(rb'"id":"call_[0-9a-f]{24}"')
_CREATED = re.compile(rb'"created":\d+')


def normal(raw: bytes) -> bytes:
    """The random parts of an answer fixed: each ``chatcmpl-``/``cmpl-`` id with 32 zeros, ``created``
    1700000000, every tool call id ``call_0``."""
    raw = _ID.sub(lambda m: b'"id":"' + m.group(1) + b"-" + b"0" * 32 + b'"', raw)
    raw = _CALL_ID.sub(b'"id":"call_0"', raw)
    return _CREATED.sub(b'"created":1700000000', raw)


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def head(obj: str, chat: bool = True, model: str = "tiny") -> dict:
    prefix = "chatcmpl" if chat else "cmpl"
    return {
        "object": obj,
        "id": f"{prefix}-{'0' * 32}",
        "created": 1700000000,
        "model": model,
        "system_fingerprint": "0.1.0-native",
    }


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def chunks(raw: bytes) -> list[dict]:
    """`data: <json>` events ending with exactly one `data: [DONE]`."""
    assert raw.endswith(b"\n\n" + DONE) or raw == DONE, raw[-200:]
    return [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n")[:-2]]


def error(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> bytes:
    """OpenAI's error object, as these routes answer every error."""
    return dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


@pytest.fixture
def served():
    return text_app()


async def post(served, path: str, payload, **kwargs):
    async with served.client() as http:
        return await http.post(path, json=payload, **kwargs)


# --- chat ----------------------------------------------------------------------------------------------------


async def test_chat_completion(served):
    served.fake.reply(Script(text=FOX))
    r = await post(
        served, "/v1/chat/completions", {"model": "tgi", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    )
    assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
    assert re.fullmatch(rb'\{"object":"chat\.completion","id":"chatcmpl-[0-9a-f]{32}",.*', r.content)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": " the quick brown"},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    body = {**head("chat.completion"), "choices": [choice], "usage": usage(CHAT_PROMPT_TOKENS, 3)}
    assert normal(r.content) == dumps(body)  # "tgi" -> the served model's id
    assert (r.headers["x-generated-tokens"], r.headers["x-prompt-tokens"]) == ("3", str(CHAT_PROMPT_TOKENS))
    assert r.headers["x-compute-characters"] == str(len("<|user|>What is deep learning?</s><|assistant|>"))
    request = served.fake.requests[0]
    assert request.prompt == "<|user|>What is deep learning?</s><|assistant|>" and not request.params.do_sample


async def test_chat_stop_reason_and_requested_model_echoed():
    served = text_app(served_model_name="my-model, other")  # an alias is echoed
    served.fake.reply(Script(text=" the quick"))
    r = await post(served, "/v1/chat/completions", {"model": "my-model", "messages": MESSAGES})
    body = json.loads(r.content)
    assert body["model"] == "my-model"
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"] == " the quick"
    assert body["usage"] == usage(CHAT_PROMPT_TOKENS, 3)
    assert served.fake.requests[0].params.do_sample  # no temperature: sampling
    assert served.fake.requests[0].params.max_new_tokens == 256 - CHAT_PROMPT_TOKENS


async def test_chat_stream_matches_the_whole_answer(served):
    served.fake.reply(Script(text=FOX))
    payload = {"messages": MESSAGES, "max_completion_tokens": 3, "temperature": 0}
    whole = (await post(served, "/v1/chat/completions", payload)).json()
    r = await post(
        served, "/v1/chat/completions", {**payload, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert (r.headers["content-type"], r.headers["cache-control"], r.headers["x-accel-buffering"]) == (
        "text/event-stream",
        "no-cache",
        "no",
    )
    pieces = [" the", " quick", " brown"]
    events = [
        {
            **head("chat.completion.chunk"),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": piece},
                    "logprobs": None,
                    "finish_reason": "length" if i == 2 else None,
                    "stop_reason": None,
                }
            ],
            "usage": None,
        }
        for i, piece in enumerate(pieces)
    ]
    events.append({**head("chat.completion.chunk"), "choices": [], "usage": whole["usage"]})
    assert normal(r.content) == b"".join(b"data: " + dumps(e) + b"\n\n" for e in events) + DONE
    assert len(set(re.findall(rb"chatcmpl-[0-9a-f]{32}", r.content))) == 1  # one id in every chunk


async def test_chat_logprobs_and_seeded_sampling(served):
    payload = {"messages": MESSAGES, "max_tokens": 3, "seed": 5, "logprobs": True, "top_logprobs": 2}
    a = (await post(served, "/v1/chat/completions", payload)).json()
    b = (await post(served, "/v1/chat/completions", payload)).json()
    assert a["choices"] == b["choices"]
    content = a["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0] == {"token": c["token"], "logprob": c["logprob"]} for c in content)
    c = (await post(served, "/v1/chat/completions", {**payload, "seed": 6})).json()
    assert c["choices"] != a["choices"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_seed_with_n_gives_each_choice_its_own_reproducible_stream(served, route):
    first = {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": FOX}
    payload = {**first, "max_tokens": 4, "n": 2, "seed": 7, "ignore_eos": True}
    a = (await post(served, route, payload)).json()
    assert a["choices"] == (await post(served, route, payload)).json()["choices"]
    assert a["choices"][0] != a["choices"][1]  # choice i samples from seed + i
    assert (served.fake.requests[0].params.n, served.fake.requests[0].params.seed) == (2, 7)


async def test_a_logit_bias_outside_the_vocabulary_is_400(served):
    r = await post(served, "/v1/completions", {"prompt": FOX, "logit_bias": {"600": 1, "3": 2}})
    assert r.status_code == 400
    assert r.content == error("`logit_bias` token ids [600] are outside the vocabulary (0..511)", param="logit_bias")


async def test_sampling_fields_reach_the_engine(served):
    payload = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "top_k": -1,
        "min_p": 0.2,
        "logit_bias": {"5": -100},
        "skip_special_tokens": False,
        "bad_words": ["fox"],
    }
    r = await post(served, "/v1/chat/completions", payload)
    assert r.status_code == 200, r.text
    p = served.fake.requests[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.0)
    assert (p.top_k, p.min_p, p.logit_bias, p.skip_special_tokens) == (0, 0.2, {5: -100.0}, False)
    assert p.bad_words == ["fox"] and not p.bad_words_ids  # the request as built: the engine tokenizes them
    assert served.fake.ran[0].bad_words_ids  # for the parameters its sequences run with


async def test_unknown_fields_are_accepted_and_logged_once_per_name(served, caplog):
    payload = {"messages": MESSAGES, "max_tokens": 2, "no_such_option_x": 1, "other_option_y": True}
    with caplog.at_level(logging.WARNING, logger="lmiserve.protocols.openai.schema"):
        for _ in range(2):
            assert (await post(served, "/v1/chat/completions", payload)).status_code == 200
    warned = [r.getMessage() for r in caplog.records if r.name == "lmiserve.protocols.openai.schema"]
    assert sorted(warned) == [
        "ignoring unknown request field no_such_option_x (not supported by this server)",
        "ignoring unknown request field other_option_y (not supported by this server)",
    ]


async def test_chat_n_choices(served):
    payload = {"messages": MESSAGES, "max_tokens": 3, "n": 2, "temperature": 0.8, "ignore_eos": True}
    body = (await post(served, "/v1/chat/completions", payload)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] != body["choices"][1]["message"]
    assert body["usage"]["completion_tokens"] == 6
    assert (served.fake.requests[0].params.n, served.fake.requests[0].params.best_of) == (2, 2)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_n_choices_stream_interleaved_as_they_are_generated(served, route):
    first = {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": FOX}
    payload = {**first, "max_tokens": 6, "n": 2, "seed": 3, "ignore_eos": True, "stream": True}
    events = [e for e in chunks((await post(served, route, payload)).content) if e["choices"]]
    order = [e["choices"][0]["index"] for e in events]
    assert sorted(order) == [0] * 6 + [1] * 6
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 starts before choice 0 ends
    assert not served.fake.requests[0].ranked and served.fake.requests[0].params.n == 2
    texts = [c.get("text") or c.get("delta", {}).get("content", "") for e in events for c in e["choices"]]
    streamed = ["".join(t for t, i in zip(texts, order) if i == index) for index in (0, 1)]
    assert streamed[0] != streamed[1]  # each choice its own stream (seed + index)


@pytest.mark.parametrize(
    ("extra", "body"),
    [
        (
            {"max_tokens": 5000},
            error(  # OpenAI's words and code: clients (litellm, langchain) recognise a context overflow by them
                "This model's maximum context length is 256 tokens. However, you requested 5010 tokens (10 in the "
                "messages, 5000 in the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            ),
        ),
        ({"top_p": 1.5}, error("`top_p` must be in (0, 1], got 1.5", param="top_p")),
        (
            {"n": 2, "temperature": 0},
            error("`n` > 1 requires sampling (a `temperature` other than 0)", param="n"),
        ),
        ({"temperature": 5}, error("`temperature` must be in [0, 2], got 5", param="temperature")),
        ({"n": 17}, error("`n` must be <= 16. Given: 17", param="n")),
        (
            {"messages": [{"role": "user", "content": "word " * 300}]},
            error(
                "This model's maximum context length is 256 tokens (at most 255 in the messages). However, your "
                "messages resulted in 606 tokens. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            ),
        ),
        ({"response_format": {"type": "yaml"}}, None),
        ({"guided_regex": "(("}, None),
        ({"guided_regex": "a+", "guided_choice": ["b"]}, None),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            None,
        ),
    ],
    ids=[
        "too-long",
        "top-p",
        "n-greedy",
        "temperature",
        "n-max",
        "prompt-too-long",
        "format",
        "regex",
        "two",
        "format-and-regex",
        "schema",
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_validation_errors_come_before_the_stream(served, extra, body, stream):
    r = await post(served, "/v1/chat/completions", {"messages": MESSAGES, "stream": stream, **extra})
    assert (r.status_code, r.headers["content-type"]) == (400, "application/json")
    if body is not None:
        assert r.content == body
    else:
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] is None
    assert served.fake.requests == []


@pytest.mark.parametrize(
    ("payload", "status", "body"),
    [
        (
            {"messages": []},
            400,
            error(
                "Failed to deserialize the JSON body into the target type: messages: List should have at least 1 item after validation, not 0",
                param="messages",
            ),
        ),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, None),
        (
            {"messages": MESSAGES, "stream": "yes"},
            400,
            error(
                "Failed to deserialize the JSON body into the target type: stream: Input should be a valid boolean",
                param="stream",
            ),
        ),
    ],
    ids=["no-messages", "bad-tool", "bad-stream"],
)
async def test_chat_rejections(served, payload, status, body):
    r = await post(served, "/v1/chat/completions", payload)
    assert (r.status_code, r.headers["content-type"]) == (status, "application/json")
    if body is not None:
        assert r.content == body
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["message"].startswith("Tool error: ")


ROLE_ERROR = (
    "Invalid value: 'wizard'. Supported values are: 'system', 'assistant', 'user', 'function', 'tool', and 'developer'."
)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_role_openai_does_not_accept_is_400(served, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "wizard", "content": "Abracadabra"}]
    r = await post(served, "/v1/chat/completions", {"messages": messages, "stream": stream})
    assert (r.status_code, r.headers["content-type"]) == (400, "application/json")
    assert r.content == error(ROLE_ERROR, param="messages[1].role", code="invalid_value")
    assert not served.fake.requests


async def test_every_role_openai_accepts_is_accepted(served):
    roles = ["developer", "system", "user", "assistant", "tool", "function", "user"]
    messages = [{"role": role, "content": "x", "tool_call_id": "c", "name": "f"} for role in roles]
    r = await post(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


async def test_chat_accepts_openai_defaults_and_null_options(served):
    payload = {"messages": MESSAGES, "max_tokens": 2, "top_p": 1.0, "stop": None, "stream_options": None}
    r = await post(served, "/v1/chat/completions", payload)
    assert r.status_code == 200 and served.fake.requests[0].params.top_p == 1.0


async def test_chat_stop_and_min_tokens(served):
    served.fake.reply(Script(text=FOX))
    body = (
        await post(served, "/v1/chat/completions", {"messages": MESSAGES, "stop": " brown", "temperature": 0})
    ).json()
    assert body["choices"][0]["message"]["content"] == " the quick"  # the stop string left out
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", " brown")
    payload = {"messages": MESSAGES, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True, "temperature": 0}
    body = (await post(served, "/v1/chat/completions", payload)).json()
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == ("length", 8)


# --- completions -------------------------------------------------------------------------------------------------


async def test_completions_two_prompts(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": ["Deep learning is", "Hello"], "max_tokens": 3, "temperature": 0}
    r = await post(served, "/v1/completions", payload)
    choices = [
        {"index": i, "text": " the quick brown", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        for i in range(2)
    ]
    body = {**head("text_completion", chat=False), "choices": choices, "usage": usage(4 + 2, 6)}
    assert normal(r.content) == dumps(body)
    assert [r.prompt for r in served.fake.requests] == ["Deep learning is", "Hello"]
    assert r.headers["x-compute-characters"] == str(len("Deep learning is") + len("Hello"))


async def test_completions_echo_and_logprobs(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    choice = (await post(served, "/v1/completions", payload)).json()["choices"][0]
    assert choice["text"] == "Hello the quick"
    assert choice["logprobs"]["tokens"] == ["<s>", "Hello", " the", " quick"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -0.5, -0.5]  # the first prompt token has none
    assert choice["logprobs"]["text_offset"] == [0, 0, 5, 9]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(top) == 2 for top in tops[1:])  # the 2 most likely, the token among them
    for token, logprob, top in zip(
        choice["logprobs"]["tokens"][1:], choice["logprobs"]["token_logprobs"][1:], tops[1:]
    ):
        assert top[token] == logprob


# --- scoring prompts (openai.scoring): what lm-eval's loglikelihood tasks send -------------------------------------


async def test_completions_echo_scores_every_prompt_token(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": "Deep learning is", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 3}
    choice = (await post(served, "/v1/completions", payload)).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == logprob and 3 <= len(top) <= 4
    text = choice["text"]
    assert text == "Deep learning is the"
    assert [text[o : o + len(t)] for t, o in zip(lp["tokens"][1:], lp["text_offset"][1:])] == lp["tokens"][1:]
    params = served.fake.requests[0].params
    assert (params.decoder_input_details, params.prompt_top_n, params.top_n_tokens) == (True, 3, 3)


async def test_completions_logprobs_zero_gives_the_token_alone(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "logprobs": 0}
    lp = (await post(served, "/v1/completions", payload)).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [" the", " quick"] and lp["top_logprobs"] == [{" the": -0.5}, {" quick": -0.5}]
    r = await post(served, "/v1/completions", {**payload, "echo": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [None, {"Hello": -1.5}, {" the": -0.5}, {" quick": -0.5}]


async def test_completions_max_tokens_zero_with_echo_scores_the_prompt_only(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": "Hello", "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 1}
    body = (await post(served, "/v1/completions", payload)).json()
    choice = body["choices"][0]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["<s>", "Hello"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5]
    assert body["usage"] == usage(2, 0)
    assert served.fake.requests[0].params.max_new_tokens == 1  # one token sampled, then dropped
    body = (await post(served, "/v1/completions", {**payload, "logprobs": None})).json()
    assert (body["choices"][0]["text"], body["choices"][0]["logprobs"], body["usage"]) == ("Hello", None, usage(2, 0))


@pytest.mark.parametrize(
    ("prompt", "texts", "encoded"),
    [
        ([487, 353, 300], ["Deep learning is"], [[487, 353, 300]]),
        ([[1, 487], [353, 300]], ["Deep", " learning is"], [[1, 487], [353, 300]]),
    ],
    ids=["ids", "lists-of-ids"],
)
async def test_completions_token_id_prompts(served, prompt, texts, encoded):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    body = (await post(served, "/v1/completions", payload)).json()
    assert served.fake.encoded == encoded  # used as given: no BOS added
    assert [c["text"] for c in body["choices"]] == [t + " the" for t in texts]
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in encoded)
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [len(ids) + 1 for ids in encoded]


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_token_ids_outside_the_vocabulary(served, stream):
    r = await post(served, "/v1/completions", {"prompt": [487, 512], "max_tokens": 1, "stream": stream})
    assert (r.status_code, r.content) == (400, error("Token id 512 is out of vocabulary (0..511)"))
    r = await post(served, "/v1/completions", {"prompt": [[487], [-1]], "max_tokens": 1})
    assert (r.status_code, r.content) == (400, error("Token id -1 is out of vocabulary (0..511)"))


async def test_completions_prompt_logprobs_as_vllm_renders_them(served):
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": "Deep learning", "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = (await post(served, "/v1/completions", payload)).json()["choices"][0]
    rendered = choice["prompt_logprobs"]
    assert len(rendered) == 3 and rendered[0] is None
    assert rendered[1]["487"] == {"logprob": -1.5, "rank": 1, "decoded_token": "Deep"}
    assert rendered[2]["353"] == {"logprob": -1.5, "rank": 1, "decoded_token": " learning"}
    assert all(len(entry) == 2 for entry in rendered[1:])  # the token is the most likely: 2 entries
    assert [e["rank"] for e in rendered[1].values()] == [1, 2]
    assert choice["text"] == " the" and choice["logprobs"] is None  # no echo
    r = await post(served, "/v1/completions", {**payload, "prompt_logprobs": 0})
    assert r.json()["choices"][0]["prompt_logprobs"][1] == {
        "487": {"logprob": -1.5, "rank": 1, "decoded_token": "Deep"}
    }
    r = await post(served, "/v1/completions", {**payload, "max_tokens": 2})
    assert "prompt_logprobs" in r.json()["choices"][0]
    r = await post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert "prompt_logprobs" not in r.json()["choices"][0]  # only when asked (the golden bytes stay)


async def test_chat_prompt_logprobs(served):
    served.fake.reply(Script(text=FOX))
    payload = {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1}
    body = (await post(served, "/v1/chat/completions", payload)).json()
    rendered = body["prompt_logprobs"]
    assert len(rendered) == CHAT_PROMPT_TOKENS and rendered[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] == 1 for entry in rendered[1:])
    r = await post(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert "prompt_logprobs" not in r.json()
    r = await post(served, "/v1/chat/completions", {**payload, "stream": True})
    assert r.status_code == 400 and "`prompt_logprobs` is not supported when streaming" in r.json()["error"]["message"]


MAX_LOGPROBS = "must be <= 20 (the server's max_logprobs). Given: 21"


@pytest.mark.parametrize(
    ("path", "payload", "body"),
    [
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, error(f"`logprobs` {MAX_LOGPROBS}", param="logprobs")),
        (
            "/v1/completions",
            {"prompt": "a", "prompt_logprobs": 21},
            error(f"`prompt_logprobs` {MAX_LOGPROBS}", param="prompt_logprobs"),
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
            error(f"`top_logprobs` {MAX_LOGPROBS}", param="top_logprobs"),
        ),
        (
            "/v1/completions",
            {"prompt": "a", "max_tokens": 0},
            error(
                "`max_tokens` must be at least 1, got 0 (0 needs `echo`: the prompt scored alone)", param="max_tokens"
            ),
        ),
        (
            "/v1/completions",
            {"prompt": "a", "max_tokens": 0, "echo": True, "stream": True},
            error("`max_tokens` 0 (the prompt scored alone) is not supported when streaming", param="max_tokens"),
        ),
        (
            "/v1/completions",
            {"prompt": "a", "prompt_logprobs": 1, "stream": True},
            error("`prompt_logprobs` is not supported when streaming", param="prompt_logprobs"),
        ),
    ],
    ids=["logprobs", "prompt-logprobs", "top-logprobs", "zero-tokens", "zero-tokens-stream", "prompt-logprobs-stream"],
)
async def test_scoring_limits_and_refusals(served, path, payload, body):
    r = await post(served, path, payload)
    assert (r.status_code, r.headers["content-type"], r.content) == (400, "application/json", body)


async def test_max_logprobs_is_the_one_limit_of_chat_and_completions(served):
    served.fake.reply(Script(text=FOX))
    r = await post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1, "logprobs": 20})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 20
    payload = {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 20}
    r = await post(served, "/v1/chat/completions", payload)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    small = text_app(max_logprobs=2)
    r = await post(small, "/v1/completions", {"prompt": "a", "logprobs": 3})
    assert (
        r.status_code == 400 and "`logprobs` must be <= 2 (the server's max_logprobs)" in r.json()["error"]["message"]
    )


async def test_completions_stream_per_prompt(served):
    served.fake.reply(Script(text=FOX))
    r = await post(served, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0, "stream": True})
    events = chunks(r.content)
    assert len(events) == 6
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert [e["choices"][0]["text"] for e in mine] == [" the", " quick", " brown"]
        assert [e["choices"][0]["finish_reason"] for e in mine] == [None, None, "length"]
    assert not any("usage" in e for e in events)  # only `stream_options.include_usage` asks for it (vLLM's)


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
async def test_a_completions_stream_has_no_usage_unless_asked(served, options):
    payload = {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": options}
    events = chunks((await post(served, "/v1/completions", payload)).content)
    assert len(events) == 2 and all(e["choices"] and "usage" not in e for e in events)


async def test_a_completions_stream_with_include_usage_ends_with_a_usage_chunk(served):
    """vLLM's: with `stream_options.include_usage` a last chunk with empty `choices` and the usage of every
    prompt and choice together, before [DONE]; whole answers count the same."""
    served.fake.reply(Script(text=FOX))
    payload = {"prompt": ["a", "Hello"], "max_tokens": 3, "n": 2, "temperature": 0.5, "ignore_eos": True}
    whole = (await post(served, "/v1/completions", payload)).json()
    options = {"include_usage": True}
    r = await post(served, "/v1/completions", {**payload, "stream": True, "stream_options": options})
    events = chunks(r.content)
    assert len(events) == 2 * 2 * 3 + 1 and all(e["choices"] and "usage" not in e for e in events[:-1])
    assert normal(dumps(events[-1])) == dumps(
        {
            "object": "text_completion",
            "id": f"cmpl-{'0' * 32}",
            "created": 1700000000,
            "choices": [],
            "model": "tiny",
            "system_fingerprint": "0.1.0-native",
            "usage": usage(2 + 2, 12),
        }
    )
    assert events[-1]["usage"] == whole["usage"]


async def test_completions_n_indexes(served):
    payload = {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "temperature": 0.7}
    body = (await post(served, "/v1/completions", payload)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("payload", "body"),
    [
        ({"prompt": []}, error("Empty array detected. Do not use an empty array for the prompt.")),
        ({"prompt": "a", "suffix": None}, (GOLDEN / "error_suffix.json").read_bytes()),
        (
            {"prompt": ["a"] * 33},
            error(
                "Number of prompts exceeds the maximum allowed batch size of 32 "
                "(the server's max_rolling_batch_size, vLLM's max_num_seqs)"
            ),
        ),
        ({"prompt": [[1], []]}, error("Empty array detected. Do not use an empty array for the prompt.")),
    ],
    ids=["empty", "suffix", "too-many", "empty-ids"],
)
async def test_completions_errors(served, payload, body):
    r = await post(served, "/v1/completions", payload)
    assert (r.status_code, r.headers["content-type"], r.content) == (400, "application/json", body)


async def test_completion_ignore_eos_forces_exact_token_count(served):
    """vLLM's `ignore_eos`/`min_tokens` extension, which benchmark clients (lmiserve bench) send."""
    served.fake.reply(Script(text=FOX))
    payload = {
        "prompt": "Hello",
        "max_tokens": 24,
        "min_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    events = [e for e in chunks((await post(served, "/v1/completions", payload)).content) if e["choices"]]
    assert len(events) == 24 and events[-1]["choices"][0]["finish_reason"] == "length"
    params = served.fake.requests[0].params
    assert (params.ignore_eos_token, params.min_new_tokens) == (True, 24)


# --- engine errors, the client going away ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [
        (
            Overloaded("Worker queue capacity exceeded"),
            429,
            error("Worker queue capacity exceeded", "rate_limit_error"),
        ),
        (QueueTimeout("Time out in: 2"), 503, error("Time out in: 2", "service_unavailable_error")),
        (InvalidRequest("bad"), 400, error("bad")),
        (
            ModelNotReady("The server is shutting down"),  # under a request that started: a failure
            500,
            error("The server is shutting down", "server_error"),
        ),
    ],
    ids=["overloaded", "queue-timeout", "invalid", "stopped"],
)
async def test_engine_errors(served, exc, status, body):
    served.fake.reply(Script(error=exc))
    r = await post(served, "/v1/chat/completions", {"messages": MESSAGES})
    assert (r.status_code, r.content) == (status, body)
    r = await post(served, "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
    in_band = b"data: " + body + b"\n\n" + DONE  # the same error object, after the 200
    assert (r.status_code, r.content) == (200, in_band)


async def test_a_failure_after_the_first_chunk_is_an_error_event_then_done(served):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=1))
    r = await post(served, "/v1/completions", {"prompt": "a", "stream": True, "temperature": 0})
    events = normal(r.content).split(b"\n\n")
    assert events[0].startswith(b'data: {"object":"text_completion"') and b'"text":" the"' in events[0]
    failure = error("CUDA out of memory", "server_error")
    assert events[1:] == [b"data: " + failure, b"data: [DONE]", b""]
    r = await post(served, "/v1/completions", {"prompt": "a", "temperature": 0})
    assert (r.status_code, r.content) == (500, failure)


async def test_a_client_that_goes_away_aborts_the_generation(served):
    served.fake.reply(Script(text=FOX, hold_after=1))
    async with served.exchange("/v1/chat/completions", {"messages": MESSAGES, "stream": True}) as ex:
        first = await ex.chunk()
        assert b'"content":" the"' in first
        await ex.disconnect()
    assert served.fake.aborted == [served.fake.requests[0].request_id]
    assert (served.fake.running, served.fake.waiting) == (0, 0)


async def several_prompts_abandoned(served) -> None:
    served.fake.reply(Script(text=FOX, hold_after=1))
    async with served.exchange("/v1/completions", {"prompt": ["a", "b"], "stream": True}) as ex:
        await ex.chunk()
        await ex.disconnect()
    assert sorted(served.fake.aborted) == sorted(r.request_id for r in served.fake.requests)
    assert len(served.fake.aborted) == 2


async def test_a_client_that_goes_away_from_several_prompts_aborts_them_all(served):
    await several_prompts_abandoned(served)


async def test_a_client_that_goes_away_from_several_prompts_logs_no_error(served, caplog):
    await several_prompts_abandoned(served)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


# --- /invocations dispatch -----------------------------------------------------------------------------------------


async def test_invocations_messages_is_a_chat_completion(served):
    served.fake.reply(Script(text=FOX))
    payload = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    via_invocations = await post(served, "/invocations", payload)
    direct = await post(served, "/v1/chat/completions", payload)
    assert normal(via_invocations.content) == normal(direct.content)


async def test_invocations_prompt_is_a_completion_and_inputs_stays_lmi(served):
    served.fake.reply(Script(text=FOX))
    r = await post(served, "/invocations", {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True})
    assert chunks(r.content)[0]["object"] == "text_completion"
    r = await post(served, "/invocations", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.content == b'{"generated_text": " the quick"}'
    r = await post(served, "/invocations", {"messages": []})  # the chat route's errors, in its shape
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Failed to deserialize")


# --- tools ------------------------------------------------------------------------------------------------------

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
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
CALL = '{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}'
ARGUMENTS = '{"city":"Paris","unit":"celsius"}'


@pytest.fixture
def tools():
    return text_app(max_context=4096)  # the tools' system prompt alone is ~300 tiny tokens


def tool_chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME], **extra}


async def test_required_call(tools):
    tools.fake.reply(Script(text=CALL, eos=False))  # the grammar ends the answer after the call
    r = await post(tools, "/v1/chat/completions", tool_chat(tool_choice="required", max_tokens=100, temperature=0))
    assert r.status_code == 200, r.text
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, "tool_calls": [call]},
        "logprobs": None,
        "finish_reason": "tool_calls",
        "stop_reason": None,
    }
    prompt_tokens = len(tools.fake.encoded[0])
    completion_tokens = len(tools.fake.ids(CALL))
    body = {**head("chat.completion"), "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}
    assert normal(r.content) == dumps(body)
    request = tools.fake.requests[0]
    assert request.params.grammar is not None and request.params.grammar.kind == "json_schema"
    assert request.prompt.startswith('<|system|>You can call the following functions:\n{"name": "get_weather"')
    assert 'To call a function, reply with {"name": <function name>, "parameters": <its arguments>}' in request.prompt
    assert request.prompt.endswith("<|user|>Weather in Paris?</s><|assistant|>")


async def test_stream_of_a_call_matches_the_whole_answer(tools):
    tools.fake.reply(Script(text=CALL, eos=False))
    payload = tool_chat(tool_choice="required", max_tokens=100, temperature=0)
    whole = (await post(tools, "/v1/chat/completions", payload)).json()["choices"][0]["message"]["tool_calls"]
    r = await post(tools, "/v1/chat/completions", {**payload, "stream": True})
    events = chunks(r.content)
    calls: dict[int, dict] = {}
    for event in events:
        for delta in event["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
            if "id" in delta:
                assert call["name"] is None and delta["id"].startswith("call_")  # id and name once, first
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]


async def test_parallel_calls_named_tool_and_content(tools):
    both = f'[{CALL},{{"name":"get_time","parameters":{{"zone":"UTC"}}}}]'
    tools.fake.reply_once(Script(text=both, eos=False))
    message = (await post(tools, "/v1/chat/completions", tool_chat(max_tokens=200))).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert message["tool_calls"][1]["function"]["arguments"] == '{"zone":"UTC"}'
    tools.fake.reply_once(Script(text='{"content":"It is sunny."}'))  # auto: no grammar ends it, the model does
    choice = (await post(tools, "/v1/chat/completions", tool_chat(max_tokens=200))).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."} and choice["finish_reason"] == "stop"
    tools.fake.reply_once(Script(text=CALL, eos=False))  # a named tool: the grammar allows that one only
    named = tool_chat(tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=100)
    r = await post(tools, "/v1/chat/completions", named)
    assert r.status_code == 500 and "does not follow the grammar" in r.json()["error"]["message"]


async def test_max_tokens_mid_call_returns_no_half_call(tools):
    tools.fake.reply(Script(text=CALL, eos=False))
    ids = tools.fake.ids(CALL)
    cut = len(tools.fake.ids('{"name":"get_weather","parameters":{"ci'))  # inside the arguments
    sent = tools.fake.tokenizer.decode(ids[:cut]).removeprefix('{"name":"get_weather","parameters":')
    payload = tool_chat(tool_choice="required", max_tokens=cut, temperature=0)
    choice = (await post(tools, "/v1/chat/completions", payload)).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"] == {"role": "assistant", "content": None}
    events = chunks((await post(tools, "/v1/chat/completions", {**payload, "stream": True})).content)
    arguments = "".join(
        d["function"]["arguments"] for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])
    )
    assert arguments == sent == '{"cit' and events[-1]["choices"][0]["finish_reason"] == "length"  # sent in part


async def test_tool_choice_none_is_plain_text(tools):
    tools.fake.reply(Script(text=FOX))
    payload = tool_chat(tool_choice="none", max_tokens=5, temperature=0)
    choice = (await post(tools, "/v1/chat/completions", payload)).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": FOX} and "tool_calls" not in choice["message"]
    assert tools.fake.requests[0].params.grammar is None


async def test_tools_and_response_format_are_exclusive(tools):
    payload = tool_chat(tool_choice="required", response_format={"type": "json_object"})
    r = await post(tools, "/v1/chat/completions", payload)
    assert (r.status_code, r.content) == (400, error("Tool error: Grammar and tools are mutually exclusive"))


# --- structured output ---------------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


async def test_response_format_json_schema(served):
    served.fake.reply(Script(text='{"city":"Paris","population":2100000}', eos=False))
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    payload = {"messages": MESSAGES, "max_tokens": 100, "response_format": response_format}
    choice = (await post(served, "/v1/chat/completions", payload)).json()["choices"][0]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": '{"city":"Paris","population":2100000}'},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    r = await post(served, "/v1/chat/completions", {**payload, "stream": True})
    reasons = [e["choices"][0]["finish_reason"] for e in chunks(r.content)]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    served.fake.reply(Script(text='{"city":"Paris","population":2100000}', eos=False))
    choice = (await post(served, "/v1/chat/completions", {**payload, "max_tokens": 3})).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


async def test_completions_guided_choice_and_regex(served):
    served.fake.reply_once(Script(text="rainy", eos=False), Script(text="+1 555-0100", eos=False))
    r = await post(
        served, "/v1/completions", {"prompt": "Weather:", "max_tokens": 10, "guided_choice": ["sunny", "rainy"]}
    )
    assert r.json()["choices"][0]["text"] == "rainy" and r.json()["choices"][0]["finish_reason"] == "stop"
    regex = r"\+1 [0-9]{3}-[0-9]{4}"
    r = await post(served, "/v1/completions", {"prompt": "Phone:", "max_tokens": 20, "guided_regex": regex})
    assert r.json()["choices"][0]["text"] == "+1 555-0100"


# --- the golden files (their tokens scripted) through the whole HTTP path -------------------------------------------

GOLDEN_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is deep learning?"}]
SO = 209  # the token "\x0e" the tiny model generates first for GOLDEN_MESSAGES (ids: see the tokenizer)
ASSISTANT = 6  # <|assistant|>, a special token (no text in the answer)
CHAT_LOGPROBS = Script(
    ids=[SO, ASSISTANT, ASSISTANT],
    logprobs=[-3.3089704513549805, -2.793959379196167, -2.2042641639709473],
    top=[
        [(SO, -3.3089704513549805), (306, -3.435838460922241)],  # 306: "ed"
        [(ASSISTANT, -2.793959379196167), (508, -3.408162832260132)],  # 508: " brown"
        [(ASSISTANT, -2.2042641639709473), (101, -3.0244860649108887)],  # 101: a byte token, "�" alone
    ],
    eos=False,
)
DEEP_LEARNING = Script(  # what the tiny model generates greedily after "Deep learning is"
    ids=[116, 25, 173, 198],
    logprobs=[-2.978949785232544, -3.176013946533203, -2.9741005897521973, -1.5623784065246582],
    prompt_logprobs=[None, -6.395462989807129, -5.154427528381348, -7.468725204467773],
    prompt_top=[None, [(295, -1.3193061351776123)], [(115, -3.1792120933532715)], [(295, -2.501643419265747)]],
    eos=False,
)
GOLDEN_CASES: dict[str, tuple[str, dict, Script]] = {
    "chat_logprobs.json": (
        "/v1/chat/completions",
        {"messages": GOLDEN_MESSAGES, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        CHAT_LOGPROBS,
    ),
    "chat_model_echoed.json": (
        "/v1/chat/completions",
        {"model": "my-model", "messages": GOLDEN_MESSAGES, "max_completion_tokens": 2, "temperature": 0},
        CHAT_LOGPROBS,
    ),
    "chat_stream.sse": (
        "/v1/chat/completions",
        {"messages": GOLDEN_MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True},
        CHAT_LOGPROBS,
    ),
    "chat_stream_usage.sse": (
        "/v1/chat/completions",
        {
            "messages": GOLDEN_MESSAGES,
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        CHAT_LOGPROBS,
    ),
    "completion.json": (
        "/v1/completions",
        {"prompt": "Deep learning is", "max_tokens": 4, "temperature": 0},
        DEEP_LEARNING,
    ),
    "completion_echo_logprobs.json": (
        "/v1/completions",
        {"prompt": "Deep learning is", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1},
        DEEP_LEARNING,
    ),
    "completion_stream.sse": (
        "/v1/completions",
        {"prompt": "Deep learning is", "max_tokens": 3, "temperature": 0, "stream": True},
        DEEP_LEARNING,
    ),
    "error_suffix.json": ("/v1/completions", {"prompt": "Deep learning is", "suffix": "!"}, DEEP_LEARNING),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
async def test_golden_over_http(name):
    served = text_app(served_model_name="my-model")  # chat_model_echoed.json asks for that alias
    route, payload, script = GOLDEN_CASES[name]
    served.fake.reply(script)
    r = await post(served, route, payload)
    assert normal(r.content) == (GOLDEN / name).read_bytes()


# --- OpenAI's errors: status, error object, always JSON -------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "headers", "status", "body"),
    [
        (
            b"{not json",
            {"content-type": "application/json"},
            400,
            error(
                "Failed to parse the request body as JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
            ),
        ),
        (
            b'{"messages": []}',
            {"content-type": "text/plain"},
            415,
            error("Expected request with `Content-Type: application/json`"),
        ),
        (
            b'{"messages": "hi"}',
            {"content-type": "application/json"},
            400,
            error(
                "Failed to deserialize the JSON body into the target type: messages: Input should be a valid list",
                param="messages",
            ),
        ),
    ],
    ids=["not-json", "not-application-json", "schema"],
)
async def test_body_rejections_are_openai_errors_in_json(served, content, headers, status, body):
    for path in ("/v1/chat/completions", "/v1/completions"):
        async with served.client() as http:
            r = await http.post(path, content=content, headers=headers)
        if path == "/v1/completions" and status == 400 and b"messages" in body:
            continue  # the completions schema names its own field
        assert (r.status_code, r.headers["content-type"], r.content) == (status, "application/json", body), path


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/invocations"])
async def test_a_model_that_names_nothing_served_is_404(served, route):
    payload = {"model": "gpt-4o", "max_tokens": 2, **({"prompt": "Hi"} if route == "/v1/completions" else {})}
    if route != "/v1/completions":
        payload["messages"] = MESSAGES
    not_found = error("The model `gpt-4o` does not exist.", "not_found_error", param="model", code="model_not_found")
    r = await post(served, route, payload)
    assert (r.status_code, r.headers["content-type"], r.content) == (404, "application/json", not_found)
    r = await post(served, route, {**payload, "stream": True})  # before the stream starts
    assert (r.status_code, r.content) == (404, not_found)
    assert served.fake.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_that_names_an_adapter_is_404_not_the_base_model(served, stream):
    """No LoRA adapters are served yet: `model` naming one is an unknown model, as vLLM answers it."""
    payload = {"model": "tiny-sql-lora", "messages": MESSAGES, "stream": stream}
    r = await post(served, "/v1/chat/completions", payload)
    assert (r.status_code, r.content) == (
        404,
        error("The model `tiny-sql-lora` does not exist.", "not_found_error", "model", "model_not_found"),
    )
    with pytest.raises(openai.NotFoundError):
        await sdk(served.app).completions.create(model="tiny-sql-lora", prompt="a")
    assert served.fake.requests == []


async def test_the_model_name_in_a_404_is_a_short_escaped_excerpt(served):
    name = "a\n" + "b" * 300
    r = await post(served, "/v1/chat/completions", {"model": name, "messages": MESSAGES})
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message == "The model `a\\n" + "b" * 97 + "...` does not exist."


@pytest.mark.parametrize(
    ("options", "model", "echoed"),
    [
        ({}, "tiny", "tiny"),  # the model's own name
        ({}, "tgi", "tiny"),  # TGI clients' fixed name: the served name
        ({}, "", "tiny"),
        ({}, None, "tiny"),
        ({"served_model_name": "gpt-3.5-turbo, mine"}, "mine", "mine"),  # an alias: echoed
        ({"served_model_name": "*"}, "anything", "anything"),  # `*`: any name
    ],
)
async def test_model_names_accepted(options, model, echoed):
    served = text_app(**options)
    payload = {"messages": MESSAGES, "max_tokens": 1, **({} if model is None else {"model": model})}
    r = await post(served, "/v1/chat/completions", payload)
    assert (r.status_code, r.json()["model"]) == (200, echoed)
    r = await post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "model": model})
    assert (r.status_code, r.json()["model"]) == (200, "tiny")  # completions name the served model


async def test_an_unknown_model_stays_404_with_aliases():
    served = text_app(served_model_name="mine")
    r = await post(served, "/v1/chat/completions", {"model": "yours", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_the_api_key_error_is_openai_json():
    keyed = text_app(api_key="k")
    r = await post(keyed, "/v1/completions", {"prompt": "Hi"})
    assert (r.status_code, r.headers["content-type"], r.content) == (
        401,
        "application/json",
        error("missing or wrong API key", "authentication_error", code="invalid_api_key"),
    )


async def test_the_model_list_is_an_openai_route_with_openai_401():
    keyed = text_app(api_key="k")
    async with keyed.client() as http:
        r = await http.get("/v1/models")
        assert (r.status_code, r.headers["content-type"], r.content) == (
            401,
            "application/json",
            error("missing or wrong API key", "authentication_error", code="invalid_api_key"),
        )
        assert (await http.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 200
        for path in ("/health", "/", "/ping"):  # the probes stay open
            assert (await http.get(path)).status_code == 200, path
    with pytest.raises(openai.AuthenticationError) as denied:
        await sdk(text_app(api_key="other").app).models.list()
    assert denied.value.code == "invalid_api_key"
    assert [m.id async for m in sdk(keyed.app, "k").models.list()] == ["tiny"]


async def test_not_ready_is_503(served):
    loading = text_app(status="pending")
    r = await post(loading, "/v1/chat/completions", {"messages": MESSAGES})
    assert (r.status_code, r.headers["content-type"]) == (503, "application/json")
    assert r.json()["error"]["type"] == "service_unavailable_error"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/invocations"])
async def test_a_server_without_a_text_model_answers_404_without_a_traceback(route, caplog):
    app = tensor_app({"emb": text_model()})
    payload = {"messages": MESSAGES, "prompt": "Hi"}
    async with tensor_client(app) as http:
        r = await http.post(route, json=payload)
    message = "No text-generation model is loaded: this route needs an LLM."
    not_found = error(message, "not_found_error", param="model", code="model_not_found")
    assert (r.status_code, r.headers["content-type"], r.content) == (404, "application/json", not_found)
    assert [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR] == []


# --- stop strings and finish_reason (OpenAI's rules, vLLM's stop_reason) ---------------------------------------------


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_the_stop_string_is_left_out_and_named_in_stop_reason(served, route):
    served.fake.reply(Script(text=FOX))
    chat = route == "/v1/chat/completions"
    payload = {"stop": [" fox", " brown"], "temperature": 0, **({"messages": MESSAGES} if chat else {"prompt": "a"})}
    choice = (await post(served, route, payload)).json()["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert (text, choice["finish_reason"], choice["stop_reason"]) == (" the quick", "stop", " brown")
    choice = (await post(served, route, {**payload, "include_stop_str_in_output": True})).json()["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert (text, choice["finish_reason"], choice["stop_reason"]) == (" the quick brown", "stop", " brown")
    assert served.fake.requests[0].params.include_stop_str_in_output is False


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_never_sends_the_stop_string(served, route):
    served.fake.reply(Script(text=FOX))
    chat = route == "/v1/chat/completions"
    # " qu" could start the stop string " quiet": held back until " quick" shows it does not
    payload = {
        "stop": ["ick br"],
        "temperature": 0,
        "stream": True,
        **({"messages": MESSAGES} if chat else {"prompt": "a"}),
    }
    events = [e for e in chunks((await post(served, route, payload)).content) if e["choices"]]
    texts = [e["choices"][0]["delta"]["content"] if chat else e["choices"][0]["text"] for e in events]
    assert "".join(texts) == " the qu" and not any("ick" in t for t in texts)
    last = events[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "ick br")
    assert all(e["choices"][0]["stop_reason"] is None for e in events[:-1])


async def test_stop_token_ids_give_the_token_id_as_stop_reason(served):
    served.fake.reply(Script(text=FOX))
    quick = served.fake.ids(" quick")[0]
    payload = {"messages": MESSAGES, "stop_token_ids": [quick], "temperature": 0}
    choice = (await post(served, "/v1/chat/completions", payload)).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", quick)
    assert served.fake.requests[0].params.stop_token_ids == [quick]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_token_s_text_is_left_out_unless_asked(served, route, include):
    """vLLM's: the stop token ends the text without its own text (whole and streamed, where the last chunk
    carries the finish and no text), unless `include_stop_str_in_output`; it still counts as generated."""
    served.fake.reply(Script(text=FOX))
    chat = route == "/v1/chat/completions"
    brown = served.fake.ids(" brown")[0]
    payload = {
        "stop_token_ids": [brown],
        "temperature": 0,
        "include_stop_str_in_output": include,
        **({"messages": MESSAGES} if chat else {"prompt": "a"}),
    }
    expected = " the quick brown" if include else " the quick"
    body = (await post(served, route, payload)).json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert (text, choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", brown)
    assert body["usage"]["completion_tokens"] == 3
    options = {"include_usage": True}
    events = chunks((await post(served, route, {**payload, "stream": True, "stream_options": options})).content)
    pieces = [e["choices"][0]["delta"]["content"] if chat else e["choices"][0]["text"] for e in events[:-1]]
    assert pieces == [" the", " quick", " brown" if include else ""]
    last = events[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"], events[-1]["usage"]["completion_tokens"]) == ("stop", brown, 3)


async def test_eos_and_length_have_no_stop_reason(served):
    served.fake.reply(Script(text=" the quick"))
    eos = (await post(served, "/v1/completions", {"prompt": "a", "temperature": 0})).json()["choices"][0]
    length = (await post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1})).json()["choices"][0]
    assert (eos["finish_reason"], eos["stop_reason"], length["finish_reason"], length["stop_reason"]) == (
        "stop",
        None,
        "length",
        None,
    )


# --- stream_options, prompts per completions request, ignored fields (the `warnings` header) --------------------


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_options_without_stream_is_400(served, route):
    """vLLM's rule and message; `null` and `{}` are not "defined" (vLLM reads them so too)."""
    first = {"messages": MESSAGES} if "chat" in route else {"prompt": "a"}
    for options in ({"include_usage": True}, {"include_usage": False}):
        for stream in ({}, {"stream": False}):
            r = await post(served, route, {**first, **stream, "max_tokens": 1, "stream_options": options})
            assert (r.status_code, r.content) == (
                400,
                error("Stream options can only be defined when `stream=True`.", param="stream_options"),
            )
    assert not served.fake.requests
    for options in (None, {}):
        r = await post(served, route, {**first, "max_tokens": 1, "stream_options": options})
        assert r.status_code == 200, r.text
    r = await post(served, route, {**first, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and chunks(r.content)[-1]["choices"] == []


async def test_completions_take_as_many_prompts_as_max_num_seqs():
    """lm-eval sends 32 prompts or more: the limit is the engine's max_num_seqs (max_rolling_batch_size);
    TGI's max_client_batch_size (4) stays TGI's, in its /info."""
    served = text_app(max_num_seqs=40)
    r = await post(served, "/v1/completions", {"prompt": [f"p{i}" for i in range(40)], "max_tokens": 1})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == list(range(40))
    r = await post(served, "/v1/completions", {"prompt": [[5]] * 41, "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Number of prompts exceeds the maximum allowed batch size of 40 ")
    async with served.client() as http:
        assert (await http.get("/info")).json()["max_client_batch_size"] == 4


def _warned(names: str) -> str:
    return f'299 - "ignored fields: {names}"'


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_ignored_fields_are_named_in_the_warnings_header(served, route, stream):
    first = {"messages": MESSAGES} if "chat" in route else {"prompt": "a"}
    payload = {
        **first,
        "max_tokens": 1,
        "stream": stream,
        "metadata": {"k": "v"},  # OpenAI's, which this server does not keep
        "user": "u-1",  # accepted, not used
        "no_such_option": 0,
        "service_tier": "flex",
        "also_null": None,  # null: absent, as OpenAI reads it
        "store": False,  # OpenAI's default: nothing asked
        "modalities": ["text"],
    }
    r = await post(served, route, payload)
    assert r.status_code == 200, r.text
    assert r.headers["warnings"] == _warned("metadata, no_such_option, service_tier, user")
    r = await post(served, route, {**first, "max_tokens": 1, "stream": stream, "user": None, "store": False})
    assert r.status_code == 200 and "warnings" not in r.headers


async def test_ignored_options_of_stream_options_and_chat_top_logprobs_are_named(served):
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    payload = {"prompt": "a", "max_tokens": 1, "stream": True, "stream_options": options}
    r = await post(served, "/v1/completions", payload)
    assert r.headers["warnings"] == _warned("stream_options.continuous_usage_stats")
    r = await post(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "top_logprobs": 2})
    assert r.headers["warnings"] == _warned("top_logprobs")  # counts only with `logprobs: true`
    r = await post(
        served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}
    )
    assert "warnings" not in r.headers


async def test_the_warnings_header_escapes_and_cuts_names(served):
    names = {f"f{i:02}": 1 for i in range(25)}
    odd = {'quo"te\\': 1, "caf\u00e9\n": 1, "x" * 60: 1}
    r = await post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1, **odd, **names})
    listed = ", ".join(['quo\\"te\\\\', "caf\\u00e9\\n", "x" * 40 + "...", *names][:20])
    assert r.headers["warnings"] == _warned(listed + " and 8 more")
    assert r.headers["warnings"].isascii()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/invocations"])
async def test_strict_openai_fields_refuses_ignored_fields(route):
    served = text_app(strict_openai_fields=True)
    first = {"prompt": "a"} if route == "/v1/completions" else {"messages": MESSAGES}
    r = await post(served, route, {**first, "max_tokens": 1, "user": "u", "foo": 1})
    assert (r.status_code, r.content) == (
        400,
        error(
            "The following fields are not supported and would be ignored (the server's strict_openai_fields "
            "refuses them): `foo`, `user`",
            param="foo",
        ),
    )
    assert not served.fake.requests
    r = await post(served, route, {**first, "max_tokens": 1, "user": None, "store": False})
    assert r.status_code == 200 and "warnings" not in r.headers


def test_strict_openai_fields_from_the_environment():
    assert load_settings(environ={"OPTION_STRICT_OPENAI_FIELDS": "true"}).strict_openai_fields is True
    assert load_settings(environ={"OPTION_STRICT_OPENAI_FIELDS": "off"}).strict_openai_fields is False
    assert load_settings(environ={}).strict_openai_fields is False


# --- the real `openai` SDK over the in-process app: its exception classes -----------------------------------------


def sdk(app, key: str = "k") -> openai.AsyncOpenAI:
    """The `openai` SDK, unmodified, talking to the in-process app (no retries)."""
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


async def test_the_sdk_raises_the_class_of_each_error(served):
    client = sdk(served.app)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, top_p=1.5)
    assert (bad.value.status_code, bad.value.param, bad.value.type) == (400, "top_p", "invalid_request_error")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="gpt-4o", prompt="a")
    assert missing.value.code == "model_not_found"
    served.fake.reply_once(Script(error=Overloaded("Worker queue capacity exceeded")))
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.InternalServerError) as unavailable:
        await sdk(text_app(status="pending").app).chat.completions.create(model="tiny", messages=MESSAGES)
    assert unavailable.value.status_code == 503
    with pytest.raises(openai.AuthenticationError):
        await sdk(text_app(api_key="other").app).completions.create(model="tiny", prompt="a")
    with pytest.raises(openai.BadRequestError) as role:
        await client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    assert (role.value.code, role.value.param) == ("invalid_value", "messages[0].role")


async def test_the_sdk_raises_an_error_event_of_a_started_stream(served):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=1))
    stream = await sdk(served.app).chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="CUDA out of memory"):
        async for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
    assert texts == [" the"]


async def test_the_sdk_reads_stop_reason_and_no_stop_string(served):
    served.fake.reply(Script(text=FOX))
    completion = await sdk(served.app).chat.completions.create(
        model="tiny", messages=MESSAGES, stop=[" brown"], temperature=0
    )
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]) == (
        " the quick",
        "stop",
        " brown",
    )


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_priority_and_cache_salt_reach_the_engine_and_are_checked(served, route):
    """vLLM's scheduling fields: `priority` (lower first) and `cache_salt` (prefix blocks shared only
    within the same salt) reach the engine's request; out of range or empty is a 400."""
    body = {"model": "tgi", "max_tokens": 2}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "Hello"})
    r = await post(served, route, {**body, "priority": -4, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    request = served.fake.requests[-1]
    assert (request.priority, request.cache_salt) == (-4, "tenant-a")
    r = await post(served, route, body)
    assert (served.fake.requests[-1].priority, served.fake.requests[-1].cache_salt) == (0, None)
    for bad in ({"priority": 2**40}, {"cache_salt": ""}, {"priority": "high"}):
        r = await post(served, route, {**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in bad, (bad, r.text)


async def test_chat_generation_prompt_continue_final_message_and_prompt_truncation(served):
    """vLLM's add_generation_prompt / continue_final_message shape the rendered prompt (an open assistant
    message is continued); truncate_prompt_tokens keeps the last N prompt tokens; both checked."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    body = {"max_tokens": 2, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    r = await post(served, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert served.fake.requests[-1].prompt.endswith("<|assistant|>Hello, I am")  # left open: continued
    body = {"max_tokens": 2, "messages": messages[:1], "add_generation_prompt": False}
    r = await post(served, "/v1/chat/completions", body)
    assert r.status_code == 200 and served.fake.requests[-1].prompt.endswith("<|user|>Hi</s>")
    for bad, param in (
        ({"messages": messages, "continue_final_message": True}, None),  # with add_generation_prompt (default)
        ({"messages": messages[:1], "continue_final_message": True, "add_generation_prompt": False}, None),
        ({"messages": messages, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        r = await post(served, "/v1/chat/completions", {"max_tokens": 2, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert param is None or r.json()["error"]["param"] == param
    count = len(served.fake.requests)
    r = await post(served, "/v1/completions", {"prompt": "one two three four five", "truncate_prompt_tokens": 2})
    assert r.status_code == 200 and served.fake.requests[count].params.truncate == 2
    r = await post(served, "/v1/completions", {"prompt": "one two", "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and served.fake.requests[-1].params.truncate == 255  # the model's max input
