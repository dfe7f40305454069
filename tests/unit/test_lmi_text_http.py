"""LMI text generation over HTTP, in process, on the scripted fake engine (tests/helpers/text_app.py):
/invocations and the other inference routes, payload and parameter validation in LMI's exact
shapes, every output formatter (json, jsonlines, sse and their TGI variants) byte for byte, the golden
files of tests/golden/lmi replayed through the whole HTTP path, stop sequences, seeds, best_of, engine
errors mapped to LMI's statuses, dynamic batching, and client disconnects aborting the generation.

The error messages are checked here only; the same routes on a real server: tests/integration/test_lmi_errors.py
(a burst of bad requests the process survives), test_lmi_http.py, test_lmi_dynamic_batch.py,
test_lmi_server_options.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.text_app import Script, text_app
from helpers.tiny_model import NON_ASCII_SAMPLE
from lmiserve.core.errors import InvalidRequest, ModelNotReady, Overloaded, QueueTimeout
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "lmi"
PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "
NOT_OBJECT = (
    "Invalid request payload. Request payload should be a json object specifying the 'inputs' field. Received payload "
)
NOT_STRING = "Invalid request payload. The 'inputs' field must be a string. Received type "
EMPTY = "Invalid request payload. The 'inputs' field does not contain any content. Received payload "
PARAMS = "Invalid request payload. 'parameters' must be provided as an object of key-value pairs. Received payload "
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # 122 tokens

PROMPT = "Deep learning is"
FOX = " the quick brown fox jumps"  # 5 tokens of the tiny tokenizer
FOX_TOKENS = [(272, " the"), (496, " quick"), (508, " brown"), (473, " fox"), (475, " jumps")]
EOS = 2


def lmi(obj) -> bytes:
    """LMI's JSON spelling: ", " and ": " separators, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False).encode()


def compact_error(message: str) -> bytes:
    return json.dumps({"error": message, "code": 424}, separators=(",", ":"), ensure_ascii=False).encode()


def frontend_error(code: int, kind: str, message: str) -> bytes:
    return (json.dumps({"code": code, "type": kind, "message": message}, indent=2) + "\n").encode()


def token(token_id: int, text: str, logprob: float = -0.5, special: bool = False) -> dict:
    out = {"id": token_id, "text": text, "log_prob": logprob}
    if special:
        out["special_token"] = True
    return out


FOX_DETAILS_TOKENS = [token(i, t) for i, t in FOX_TOKENS] + [token(EOS, "", special=True)]


@pytest.fixture
def served():
    """The integration tests' default server: prompts are limited to 64 tokens."""
    return text_app(max_input_len=64)


async def post(served, payload=None, *, path="/invocations", content=None, headers=None):
    async with served.client() as http:
        if content is not None:
            return await http.post(path, content=content, headers=headers)
        return await http.post(path, json=payload, headers=headers)


def assert_424(response, message: str) -> None:
    assert (response.status_code, response.headers["content-type"]) == (424, "application/json")
    assert response.content == compact_error(message)


# --- payload validation, LMI's exact messages ------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], NOT_OBJECT + "[1, 2]"),
        ("just a string", NOT_OBJECT + "'just a string'"),
        ({"input": "hi"}, NOT_OBJECT + "{'input': 'hi'}"),
        ({"inputs": None}, NOT_OBJECT + "{'inputs': None}"),
        ({"inputs": ["a", "b"]}, NOT_STRING + "<class 'list'>"),
        ({"inputs": 5}, NOT_STRING + "<class 'int'>"),
        ({"inputs": ""}, EMPTY + "{'inputs': ''}"),
        ({"inputs": "hi", "parameters": [1]}, PARAMS + "{'inputs': 'hi', 'parameters': [1]}"),
        (
            {"inputs": "hi", "parameters": "max_new_tokens=3"},
            PARAMS + "{'inputs': 'hi', 'parameters': 'max_new_tokens=3'}",
        ),
        ({"inputs": "", "stream": True}, EMPTY + "{'inputs': '', 'stream': True}"),
        # a large payload is quoted in its first 100 characters only, then "..."
        ({"input": "x" * 200_000}, NOT_OBJECT + "{'input': '" + "x" * 89 + "..."),
        ({"inputs": "", "pad": "\n" * 100}, EMPTY + "{'inputs': '', 'pad': '" + "\\n" * 38 + "\\..."),
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
        "empty-stream",
        "large",
        "large-escaped",
    ],
)
async def test_payload_validation_messages(served, payload, message):
    assert_424(await post(served, payload), PREFIX + message)
    assert served.fake.requests == []  # refused before the engine


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b"hello", {"content-type": "application/json"}, "Expecting value: line 1 column 1 (char 0)"),
        (
            b'{"inputs": "hi"',
            {"content-type": "application/json"},
            "Expecting ',' delimiter: line 1 column 16 (char 15)",
        ),
        (b"What is Deep Learning?", {"content-type": "text/plain"}, NOT_STRING + "<class 'list'>"),
        (b"", {}, EMPTY + "{'inputs': ''}"),
    ],
    ids=["invalid-json", "truncated-json", "text-plain-is-a-list", "empty-body"],
)
async def test_body_decoding(served, content, headers, message):
    assert_424(await post(served, content=content, headers=headers), PREFIX + message)


async def test_application_jsonlines_body_is_a_sagemaker_line(served):
    """A JSON Lines body on /invocations is SageMaker's: each line an LMI request, answered by a line."""
    served.fake.reply(Script(text=FOX))
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    response = await post(served, content=body, headers={"content-type": "application/jsonlines"})
    assert (response.status_code, response.headers["content-type"]) == (200, "application/jsonlines")
    assert response.content == b'{"generated_text": " the quick"}\n'


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"temperature": -0.5, "do_sample": True},
            "Invalid value -0.5 for parameter 'temperature': Input should be greater than or equal to 0",
        ),
        ({"top_p": 0}, "Invalid value 0 for parameter 'top_p': Input should be greater than 0"),
        ({"top_p": 1.5}, "Invalid value 1.5 for parameter 'top_p': Input should be less than or equal to 1"),
        (
            {"max_new_tokens": 0},
            "Invalid value 0 for parameter 'max_new_tokens': Input should be greater than or equal to 1",
        ),
        (
            {"max_new_tokens": -3},
            "Invalid value -3 for parameter 'max_new_tokens': Input should be greater than or equal to 1",
        ),
        (
            {"max_new_tokens": "many"},
            "Invalid value 'many' for parameter 'max_new_tokens': Input should be a valid integer, unable to parse "
            "string as an integer",
        ),
        ({"top_k": -2}, "Invalid value -2 for parameter 'top_k': Input should be greater than or equal to -1"),
        (
            {"repetition_penalty": 0},
            "Invalid value 0 for parameter 'repetition_penalty': Input should be greater than 0",
        ),
        ({"stop_sequences": 5}, "Invalid value 5 for parameter 'stop_sequences': Input should be a valid list"),
        ({"max_new_tokens": 5000}, "max_new_tokens must be <= 4096. Given: 5000"),
        ({"n": 3, "best_of": 2, "do_sample": True}, "`n` (3) must be <= `best_of` (2)"),
        ({"best_of": 2}, "`n` and `best_of` > 1 require sampling (`do_sample: true` or a positive `temperature`)"),
    ],
)
async def test_invalid_parameter_values(served, parameters, message):
    assert_424(await post(served, {"inputs": "Hello", "parameters": parameters}), message)


async def test_n_greater_than_one_with_stream(served):
    response = await post(served, {"inputs": "Hello", "stream": True, "parameters": {"n": 2, "do_sample": True}})
    assert_424(response, "`n` and `best_of` > 1 are not supported when streaming")


async def test_unknown_and_null_parameters(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": "Hello", "parameters": {"foo": 1, "max_new_tokens": 2}})
    assert (response.status_code, response.content) == (200, b'{"generated_text": " the quick"}')
    response = await post(served, {"inputs": "Hello", "parameters": None})
    assert (response.status_code, response.content) == (200, lmi({"generated_text": FOX}))
    assert served.fake.requests[-1].params.max_new_tokens == 30


LMI_ADAPTER = "`{field}` names adapter `{name}`, which is not served (this model serves no LoRA adapters)"


@pytest.mark.parametrize(
    ("payload", "field", "name"),
    [
        ({"inputs": "Hello", "adapters": "my-lora"}, "adapters", "my-lora"),
        ({"inputs": "Hello", "adapters": ["my-lora"]}, "adapters", "my-lora"),
        ({"inputs": "Hello", "parameters": {"adapter_id": "my-lora"}}, "adapter_id", "my-lora"),
        ({"inputs": "Hello", "stream": True, "adapters": "x\ny"}, "adapters", "x\\ny"),
    ],
    ids=["adapters", "adapters-list", "adapter_id", "stream-escaped"],
)
async def test_an_adapter_that_is_not_served_is_not_found(served, payload, field, name):
    """404 in the compact shape (LMI answers `Adapter NAME is not registered` with its 424); served
    adapters: tests/unit/test_adapter_selection_http.py."""
    response = await post(served, payload)
    assert (response.status_code, response.headers["content-type"]) == (404, "application/json")
    message = LMI_ADAPTER.format(field=field, name=name)
    assert response.content == json.dumps({"error": message, "code": 404}, separators=(",", ":")).encode()
    assert served.fake.requests == []


async def test_no_adapter_or_the_base_model_is_the_base_model(served, caplog):
    for payload in (
        {"inputs": "Hello", "adapters": None, "parameters": {"max_new_tokens": 2}},
        {"inputs": "Hello", "adapters": "", "parameters": {"adapter_id": "tiny", "max_new_tokens": 2}},
    ):
        assert (await post(served, payload)).status_code == 200
    assert "adapter_id" not in caplog.text  # understood, not an unknown parameter


# --- prompt length (max_input_len=64), the model's 256-token context ---------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_longer_than_max_input_len(served, stream):
    response = await post(served, {"inputs": LONG_PROMPT, "stream": stream, "parameters": {"max_new_tokens": 2}})
    assert_424(response, "Input prompt (122 tokens) is too long and exceeds limit of 64")


async def test_truncate_keeps_the_last_tokens(served):
    response = await post(
        served, {"inputs": LONG_PROMPT, "parameters": {"max_new_tokens": 3, "truncate": 32, "details": True}}
    )
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] == 3
    ids = served.fake.ids(LONG_PROMPT)
    assert served.fake.encoded == [ids[-32:]]  # the last 32 of BOS + the prompt's tokens


async def test_prompt_plus_max_new_tokens_beyond_the_context(served):
    response = await post(served, {"inputs": "Hello world", "parameters": {"max_new_tokens": 255}})
    assert_424(
        response, "Input prompt (4 tokens) plus max_new_tokens (255) exceeds the model's context length of 256 tokens"
    )


async def test_engine_checks_answer_424(served):
    response = await post(served, {"inputs": "Hello", "parameters": {"stop_token_ids": [7, 600]}})
    assert_424(response, "stop_token_ids [600] are outside the vocabulary (0..511)")


async def test_structured_output_parameters(served):
    response = await post(served, {"inputs": "x", "parameters": {"max_new_tokens": 5, "json_schema": {"type": "nope"}}})
    assert response.status_code == 424 and response.json()["error"].startswith("invalid JSON schema: ")
    served.fake.reply(Script(text='{"a":1}', eos=False))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = {"max_new_tokens": 20, "json_schema": schema, "details": True}
    body = (await post(served, {"inputs": "x", "parameters": params})).json()
    assert (body["generated_text"], body["details"]["finish_reason"]) == ('{"a":1}', "eos_token")


async def test_still_healthy_after_bad_requests(served):
    await post(served, {"inputs": ""})
    await post(served, {"inputs": LONG_PROMPT})
    async with served.client() as http:
        ping = await http.get("/ping")
    assert (ping.status_code, ping.content) == (200, b'{\n  "tiny": {\n    "status": "Healthy"\n  }\n}\n')
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    assert (response.status_code, response.content) == (200, b'{"generated_text": " the quick brown fox"}')


# --- json (default, non-streaming) ------------------------------------------------------------------


async def test_json_default_body_is_exactly_generated_text(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-length"] == str(len(response.content))
    assert response.content == b'{"generated_text": " the quick brown fox jumps"}'
    assert served.fake.closed == [served.fake.requests[0].request_id] and served.fake.aborted == []


async def test_json_details_shape_and_key_order(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}})
    details = {"finish_reason": "eos_token", "generated_tokens": 6, "inputs": PROMPT, "tokens": FOX_DETAILS_TOKENS}
    assert response.content == lmi({"generated_text": FOX, "details": details})


async def test_json_details_length_and_details_false(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "details": True}})
    details = {"finish_reason": "length", "generated_tokens": 2, "inputs": PROMPT, "tokens": FOX_DETAILS_TOKENS[:2]}
    assert response.content == lmi({"generated_text": " the quick", "details": details})
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "details": False}})
    assert response.content == b'{"generated_text": " the quick"}'


async def test_decoder_input_details_and_top_tokens(served):
    top = [[(i, -0.5), (99, -1.5), (100, -2.5)] for i, _ in FOX_TOKENS]  # 99: "}", 100: "~"
    served.fake.reply(Script(text=FOX, top=top, eos=False, prompt_logprobs=[None, -6.5, -5.25, -7.5]))
    params = {"max_new_tokens": 3, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    response = await post(served, {"inputs": PROMPT, "parameters": params})
    assert response.status_code == 200, response.text
    prefill = [
        {"id": 1, "text": "<s>", "log_prob": None, "special_token": True},
        token(487, "Deep", -6.5),
        token(353, " learning", -5.25),
        token(300, " is", -7.5),
    ]
    steps = [[token(i, t), token(99, "}", -1.5)] for i, t in FOX_TOKENS[:3]]
    details = {
        "finish_reason": "length",
        "generated_tokens": 3,
        "inputs": PROMPT,
        "tokens": FOX_DETAILS_TOKENS[:3],
        "prefill": prefill,
        "top_tokens": steps,
    }
    assert response.content == lmi({"generated_text": " the quick brown", "details": details})
    assert b'"log_prob": null' in response.content


async def test_return_full_text_prepends_prompt(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "return_full_text": True}})
    assert response.content == lmi({"generated_text": PROMPT + FOX})


async def test_non_ascii_is_raw_utf8(served):
    served.fake.reply(Script(text=" café 日本語"))
    response = await post(served, {"inputs": NON_ASCII_SAMPLE, "parameters": {"max_new_tokens": 30, "details": True}})
    assert response.status_code == 200, response.text
    assert NON_ASCII_SAMPLE.encode() in response.content and " café 日本語".encode() in response.content
    assert b"\\u" not in response.content
    body = response.json()
    assert body["generated_text"] == " café 日本語" and body["details"]["inputs"] == NON_ASCII_SAMPLE
    assert "".join(t["text"] for t in body["details"]["tokens"]) == " café 日本語"


async def test_unknown_output_formatter_falls_back_to_the_default_rule(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "output_formatter": "bogus"}})
    assert response.headers["content-type"] == "application/json"
    assert response.content == b'{"generated_text": " the quick brown"}'


async def test_json_formatter_with_stream_true_gives_one_body(served):
    served.fake.reply(Script(text=FOX))
    payload = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4, "output_formatter": "json"}}
    response = await post(served, payload)
    assert response.headers["content-type"] == "application/json"
    assert response.content == b'{"generated_text": " the quick brown fox"}'


# --- jsonlines and sse ----------------------------------------------------------------------------------


def jsonlines_of(records: list[dict]) -> bytes:
    return b"".join(lmi(r) + b"\n" for r in records)


async def test_jsonlines_stream(served):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/jsonlines"
    assert "content-length" not in response.headers  # streamed
    records = [{"token": token(i, t)} for i, t in FOX_TOKENS[:3]]
    records[-1]["generated_text"] = " the quick brown"
    assert response.content == jsonlines_of(records)


async def test_jsonlines_stream_with_details_until_eos(served):
    served.fake.reply(Script(text=" the quick"))
    payload = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 5, "details": True}}
    response = await post(served, payload)
    records = [{"token": token(272, " the")}, {"token": token(496, " quick")}]
    records.append(
        {
            "token": token(EOS, "", special=True),
            "generated_text": " the quick",
            "details": {"finish_reason": "eos_token", "generated_tokens": 3, "inputs": PROMPT},
        }
    )
    assert response.content == jsonlines_of(records)


async def test_jsonlines_stream_with_prefill_and_top_tokens(served):
    params = {"max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    response = await post(served, {"inputs": PROMPT, "stream": True, "parameters": params})
    lines = [json.loads(line) for line in response.text.splitlines()]
    details = lines[-1]["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "inputs", "prefill", "top_tokens"]
    assert [t["id"] for t in details["prefill"]] == [1, 487, 353, 300]  # BOS and the prompt's tokens
    assert details["prefill"][0]["log_prob"] is None
    assert len(details["top_tokens"]) == 4 and all(len(step) == 2 for step in details["top_tokens"])
    assert [step[0]["id"] for step in details["top_tokens"]] == [line["token"]["id"] for line in lines]


async def test_jsonlines_return_full_text_changes_only_generated_text(served):
    served.fake.reply(Script(text=FOX))
    payload = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2, "return_full_text": True}}
    response = await post(served, payload)
    records = [{"token": token(272, " the")}, {"token": token(496, " quick"), "generated_text": PROMPT + " the quick"}]
    assert response.content == jsonlines_of(records)


async def test_stream_is_a_top_level_field(served):
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "stream": True}})
    assert response.headers["content-type"] == "application/json"
    payload = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "stream": False}}
    response = await post(served, payload)
    assert response.headers["content-type"] == "application/jsonlines"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "formatter-only"])
async def test_sse_per_request_formatter(served, stream):
    served.fake.reply(Script(text=" the quick"))
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "output_formatter": "sse", "details": True}}
    if stream:
        payload["stream"] = True
    response = await post(served, payload)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    last = {
        "token": token(EOS, "", special=True),
        "generated_text": " the quick",
        "details": {"finish_reason": "eos_token", "generated_tokens": 3, "inputs": PROMPT},
    }
    events = [{"token": token(272, " the")}, {"token": token(496, " quick")}, last]
    assert response.content == b"".join(b"data: " + lmi(e) + b"\n\n" for e in events)


async def test_per_request_tgi_compat_formatter(served):
    served.fake.reply(Script(text=FOX))
    params = {"max_new_tokens": 2, "output_formatter": "tgi_compat"}
    response = await post(served, {"inputs": PROMPT, "parameters": params})
    tgi_tokens = [{"id": 272, "text": " the", "logprob": -0.5}, {"id": 496, "text": " quick", "logprob": -0.5}]
    details = {"finish_reason": "length", "generated_tokens": 2, "inputs": PROMPT, "tokens": tgi_tokens}
    assert response.content == lmi([{"generated_text": " the quick", "details": details}])
    response = await post(served, {"inputs": PROMPT, "stream": True, "parameters": params})
    assert response.headers["content-type"] == "text/event-stream"
    last = {"token": tgi_tokens[1], "generated_text": " the quick", "details": details | {"tokens": None}}
    del last["details"]["tokens"]
    assert response.content == b"data: " + lmi({"token": tgi_tokens[0]}) + b"\n\ndata: " + lmi(last) + b"\n\n"


# --- max_new_tokens -------------------------------------------------------------------------------------


async def test_default_max_new_tokens_is_30(served):
    response = await post(served, {"inputs": PROMPT, "parameters": {"details": True}})
    details = response.json()["details"]
    assert (details["generated_tokens"], details["finish_reason"], len(details["tokens"])) == (30, "length", 30)
    response = await post(served, {"inputs": PROMPT, "stream": True})
    assert len(response.text.splitlines()) == 30


async def test_server_default_max_new_tokens_and_limit():
    served = text_app(max_new_tokens=5, max_new_tokens_limit=8)
    response = await post(served, {"inputs": PROMPT, "parameters": {"details": True}})
    assert response.json()["details"]["generated_tokens"] == 5
    assert_424(
        await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 9}}),
        "max_new_tokens must be <= 8. Given: 9",
    )


@pytest.mark.parametrize("n", [1, 2, 17])
async def test_max_new_tokens_is_respected(served, n):
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": n, "details": True}})
    body = response.json()
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"]) == n
    response = await post(served, {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": n}})
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert len(lines) == n and lines[-1]["generated_text"] == body["generated_text"]  # greedy: the same tokens


# --- stop sequences --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "text"),
    [
        ({"stop_sequences": [" brown"]}, " the quick"),
        ({"stop_sequences": [" brown"], "include_stop_str_in_output": True}, " the quick brown"),
        ({"stop": ["ck br"]}, " the qui"),
        ({"stop_sequences": ["\u2603\u2603"]}, FOX),
    ],
    ids=["removed", "included", "tgi-spelling-mid-token", "never-matching"],
)
async def test_stop_sequence(served, parameters, text):
    served.fake.reply(Script(text=FOX, eos=False))
    params = {"max_new_tokens": 5, "details": True, **parameters}
    body = (await post(served, {"inputs": PROMPT, "parameters": params})).json()
    reason = "length" if text == FOX else "stop_sequence"
    assert (body["generated_text"], body["details"]["finish_reason"]) == (text, reason)
    assert "".join(t["text"] for t in body["details"]["tokens"]) == text
    response = await post(served, {"inputs": PROMPT, "stream": True, "parameters": params})
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] == text
    assert lines[-1]["details"]["finish_reason"] == reason


async def test_stop_token_ids_end_the_sequence(served):
    """The stop token's text is left out unless `include_stop_str_in_output` (vLLM's, which LMI passes on)."""
    served.fake.reply(Script(text=FOX))
    params = {"stop_token_ids": [508], "details": True}  # 508: " brown"
    body = (await post(served, {"inputs": PROMPT, "parameters": params})).json()
    assert (body["generated_text"], body["details"]["finish_reason"]) == (" the quick", "stop_sequence")
    params["include_stop_str_in_output"] = True
    body = (await post(served, {"inputs": PROMPT, "parameters": params})).json()
    assert (body["generated_text"], body["details"]["finish_reason"]) == (" the quick brown", "stop_sequence")


async def test_ignore_eos_token_and_min_new_tokens(served):
    served.fake.reply(Script(text=" the quick"))
    params = {"max_new_tokens": 4, "ignore_eos_token": True, "details": True}
    details = (await post(served, {"inputs": PROMPT, "parameters": params})).json()["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", 4)
    params = {"max_new_tokens": 6, "min_new_tokens": 4, "details": True}
    details = (await post(served, {"inputs": PROMPT, "parameters": params})).json()["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", 6)  # no EOS before 4 tokens


# --- seeds and greedy determinism --------------------------------------------------------------------------


async def ids(served, **parameters) -> list[int]:
    params = {"max_new_tokens": 20, "details": True, **parameters}
    body = (await post(served, {"inputs": PROMPT, "parameters": params})).json()
    return [t["id"] for t in body["details"]["tokens"]]


async def test_seeds(served):
    seven = await ids(served, do_sample=True, seed=7)
    assert await ids(served, do_sample=True, seed=7) == seven
    assert await ids(served, do_sample=True, seed=8) != seven
    assert await ids(served, do_sample=True) != await ids(served, do_sample=True)  # a random seed per request
    assert await ids(served, temperature=1.0, seed=7) == seven  # a temperature alone means sampling
    greedy = await ids(served)
    assert greedy != seven and await ids(served) == greedy
    assert await ids(served, do_sample=False, temperature=1.0, seed=7) == greedy
    assert [r.params.do_sample for r in served.fake.requests] == [True] * 6 + [False] * 3


# --- other routes and the model name ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/predictions/tiny", "/predictions/tiny/1", "/models/tiny/invoke", "/invocations?model_name=tiny"]
)
async def test_inference_routes_behave_like_invocations(served, path):
    served.fake.reply(Script(text=FOX))
    response = await post(served, {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}, path=path)
    assert (response.status_code, response.content) == (200, lmi({"generated_text": FOX}))
    response = await post(served, {"inputs": PROMPT}, headers={"model_name": "tiny"})
    assert response.status_code == 200


async def test_unknown_model_is_404_in_the_front_end_shape(served):
    response = await post(served, {"inputs": PROMPT}, path="/predictions/foo")
    assert response.status_code == 404
    assert response.content == (GOLDEN / "error_frontend.json").read_bytes()


# --- best_of / n ----------------------------------------------------------------------------------------


async def test_best_of_shape(served):
    a, b, c = Script(text=" the quick"), Script(text=" brown", logprobs=[-0.125]), Script(text=" fox", eos=False)
    served.fake.reply(Script(sequences=[a, b, c]))
    params = {"max_new_tokens": 4, "do_sample": True, "seed": 3, "best_of": 3}  # n = best_of
    response = await post(served, {"inputs": PROMPT, "parameters": params})
    assert response.status_code == 200, response.text
    # ranked by cumulative logprob: " brown" </s> (-0.625), " the quick" </s> (-1.5), " fox" + 3 derived (-3.375)
    best = [token(508, " brown", -0.125), token(EOS, "", special=True)]
    second = [token(272, " the"), token(496, " quick"), token(EOS, "", special=True)]
    third = response.json()["details"]["best_of_sequences"][1]
    assert third["tokens"][0] == token(473, " fox") and third["generated_text"].startswith(" fox")
    details = {
        "inputs": PROMPT,
        "finish_reason": "eos_token",
        "generated_tokens": 2,
        "tokens": best,
        "best_of_sequences": [
            {"finish_reason": "eos_token", "generated_tokens": 3, "tokens": second, "generated_text": " the quick"},
            third | {"finish_reason": "length", "generated_tokens": 4},
        ],
    }
    assert response.content == lmi({"generated_text": " brown", "details": details})
    assert [(r.params.n, r.params.best_of) for r in served.fake.requests] == [(3, 3)]


async def test_n_two_of_best_of_three(served):
    params = {"max_new_tokens": 4, "do_sample": True, "seed": 3, "best_of": 3, "n": 2}
    body = (await post(served, {"inputs": PROMPT, "parameters": params})).json()
    assert len(body["details"]["best_of_sequences"]) == 1
    assert served.fake.aborted == []


# --- engine errors in LMI's shapes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "body"),
    [
        (
            Overloaded("Worker queue capacity exceeded"),
            503,
            frontend_error(503, "WlmCapacityException", "Worker queue capacity exceeded for model: tiny"),
        ),
        (QueueTimeout("Time out in: 120"), 400, frontend_error(400, "TranslateException", "Time out in: 120")),
        (InvalidRequest("nope"), 424, compact_error("nope")),
        (
            ModelNotReady("The server is shutting down"),
            503,
            frontend_error(503, "ServiceUnavailableException", "The server is shutting down"),
        ),
        (RuntimeError("boom"), 500, frontend_error(500, "InternalServerException", "boom")),
    ],
    ids=["overloaded", "queue-timeout", "invalid", "not-ready", "unexpected"],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_before_the_first_byte(served, error, status, body, stream):
    served.fake.reply(Script(error=error))
    async with served.client(raise_app_exceptions=False) as http:  # a server answers the unforeseen 500 too
        response = await http.post("/invocations", json={"inputs": PROMPT, "stream": stream})
    assert (response.status_code, response.content) == (status, body)


async def test_a_full_job_queue_is_503():
    served = text_app(job_queue_size=1)
    served.fake.reply_once(Script(hold_after=0))
    async with served.exchange("/invocations", {"inputs": PROMPT, "stream": True}) as holder:
        await served.fake.holding.wait()
        response = await post(served, {"inputs": PROMPT})
        assert response.status_code == 503
        assert response.content == frontend_error(
            503, "WlmCapacityException", "Worker queue capacity exceeded for model: tiny"
        )
        async with served.client() as http:
            described = (await http.get("/models/tiny")).json()[0]["models"][0]
        assert described["requestInQueue"] == 1
        served.fake.release()
        await holder.finish()
    assert holder.status == 200 and len(holder.chunks) == 30


@pytest.mark.parametrize("status", ["PENDING", "FAILED"])
async def test_model_not_ready(status):
    served = text_app(status=status)
    response = await post(served, {"inputs": PROMPT})
    word = "loading" if status == "PENDING" else "failed"
    assert response.status_code == 503
    assert response.content == frontend_error(503, "ServiceUnavailableException", f"Model tiny is {word}")
    async with served.client() as http:
        ping = await http.get("/ping")
    assert (ping.status_code, ping.json()) == (503, {"tiny": {"status": "Unhealthy"}})
    assert served.fake.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failure_before_the_first_byte_is_424(served, stream):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=0))
    response = await post(served, {"inputs": PROMPT, "stream": stream})
    assert_424(response, "CUDA out of memory")
    served.fake.reply(Script(events=[StepEvent(None, finish=finish(FinishReason.ERROR))]))
    response = await post(served, {"inputs": PROMPT, "stream": stream})
    assert (response.status_code, response.content) == (424, (GOLDEN / "error_compact.json").read_bytes())


async def test_a_whole_answer_failing_after_tokens_is_424(served):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=2))
    assert_424(await post(served, {"inputs": PROMPT}), "CUDA out of memory")


async def test_a_stream_failing_after_its_first_bytes_ends_in_band(served):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=2))
    response = await post(served, {"inputs": PROMPT, "stream": True})
    assert response.status_code == 200
    records = [{"token": token(272, " the")}, {"token": token(496, " quick")}]
    assert response.content == jsonlines_of(records) + compact_error("CUDA out of memory") + b"\n"
    served.fake.reply(Script(text=FOX, error=RuntimeError("lost"), error_after=1))
    response = await post(served, {"inputs": PROMPT, "stream": True})
    assert response.content == jsonlines_of(records[:1]) + compact_error("lost") + b"\n"


# --- the client goes away ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_goes_away_aborts_the_generation(served, stream):
    served.fake.reply(Script(text=FOX, hold_after=1))
    async with served.exchange("/invocations", {"inputs": PROMPT, "stream": stream}) as ex:
        await served.fake.holding.wait()
        if stream:
            assert await ex.chunk() == lmi({"token": token(272, " the")}) + b"\n"
        await ex.disconnect()
    (request,) = served.fake.requests
    assert served.fake.aborted == [request.request_id]
    assert (served.fake.running, served.fake.waiting) == (0, 0)
    if not stream:
        assert (ex.status, ex.chunks) == (499, [])


# --- the golden files, through the whole HTTP path ---------------------------------------------------------

GOLDEN_PROMPT = "What is DL?"
DEEP, LEARNING, IS = Token(304, "Deep", -0.05), Token(11157, " Learning", -1.28), Token(338, " is", -0.007)
PREFILL = (Token(1, "<s>", None), Token(1724, "What", -7.2), Token(338, " is", -1.5))
TOP = ((DEEP, Token(450, "The", -3.1)), (LEARNING, Token(6509, " learning", -1.9)), (IS, Token(29901, ":", -5.25)))


def finish(reason=FinishReason.LENGTH, text="Deep Learning is", count=3, **kw) -> Finish:
    return Finish(reason, text, count, GOLDEN_PROMPT, 4, **kw)


def golden_events(tokens=(DEEP, LEARNING, IS), fin=None, index=0, top=None) -> list[StepEvent]:
    last = len(tokens) - 1
    return [
        StepEvent(t, top[i] if top else None, (fin or finish()) if i == last else None, index)
        for i, t in enumerate(tokens)
    ]


def best_of_events() -> list[StepEvent]:
    other = finish(FinishReason.EOS_TOKEN, "Neural nets", 2)
    second = golden_events((Token(8199, "Neural", -0.9), Token(21447, " nets", -0.4)), other, index=1)
    first = golden_events()
    return [first[0], second[0], first[1], second[1], first[2]]


UNICODE = golden_events((Token(31999, "Café", -0.5), Token(30488, " 深度", -0.25), Token(243, " 🚀", -0.125)))
UNICODE[-1] = StepEvent(UNICODE[-1].token, finish=finish(text="Café 深度 🚀"))
SPECIAL = golden_events((DEEP, Token(2, "</s>", -0.01, special=True)), finish(FinishReason.EOS_TOKEN, "Deep</s>", 2))
FAILED = [*golden_events()[:2], StepEvent(None, finish=finish(FinishReason.ERROR, error="CUDA out of memory"))]
SAMPLE = {"do_sample": True, "seed": 1}

# golden file: (parameters, stream, events)
GOLDEN_CASES: dict[str, tuple[dict, bool, list[StepEvent]]] = {
    "json_default.json": ({}, False, golden_events()),
    "json_details.json": ({"details": True}, False, golden_events()),
    "json_decoder_input_details.json": (
        {"details": True, "decoder_input_details": True},
        False,
        golden_events(fin=finish(prefill=PREFILL)),
    ),
    "json_return_full_text.json": ({"return_full_text": True}, False, golden_events()),
    "json_top_n_tokens.json": ({"details": True, "top_n_tokens": 2}, False, golden_events(top=TOP)),
    "json_tgi.json": ({"output_formatter": "tgi_compat"}, False, golden_events()),
    "json_tgi_details_false.json": ({"output_formatter": "tgi_compat", "details": False}, False, golden_events()),
    "json_best_of.json": ({"best_of": 2, **SAMPLE}, False, best_of_events()),
    "json_best_of_tgi.json": ({"best_of": 2, "output_formatter": "tgi_compat", **SAMPLE}, False, best_of_events()),
    "json_best_of_single_sequence.json": ({"best_of": 2, "n": 1, **SAMPLE}, False, golden_events()),
    "json_unicode.json": ({"details": True}, False, UNICODE),
    "jsonlines_default.jsonl": ({}, True, golden_events()),
    "jsonlines_details.jsonl": ({"details": True}, True, golden_events()),
    "jsonlines_details_prefill_top_tokens.jsonl": (
        {"details": True, "decoder_input_details": True, "top_n_tokens": 2},
        True,
        golden_events(fin=finish(prefill=PREFILL), top=TOP),
    ),
    "jsonlines_return_full_text.jsonl": ({"return_full_text": True}, True, golden_events()),
    "jsonlines_special_token.jsonl": ({}, True, SPECIAL),
    "jsonlines_unicode.jsonl": ({"details": True}, True, UNICODE),
    "sse_default.sse": ({"output_formatter": "sse"}, True, golden_events()),
    "sse_tgi.sse": ({"output_formatter": "tgi_compat"}, True, golden_events()),
    "sse_tgi_special_token.sse": ({"output_formatter": "tgi_compat"}, True, SPECIAL),
    "error_tail_jsonlines.jsonl": ({}, True, FAILED),
    "error_tail_sse.sse": ({"output_formatter": "tgi_compat"}, True, FAILED),
}
CONTENT_TYPES = {".json": "application/json", ".jsonl": "application/jsonlines", ".sse": "text/event-stream"}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
async def test_golden_over_http(served, name):
    parameters, stream, events = GOLDEN_CASES[name]
    served.fake.reply(Script(events=events))
    response = await post(served, {"inputs": GOLDEN_PROMPT, "stream": stream, "parameters": parameters})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPES[Path(name).suffix]
    assert response.content == (GOLDEN / name).read_bytes()


@pytest.mark.parametrize(
    ("option", "name"), [({"output_formatter": "jsonlines"}, "jsonlines_default.jsonl"), ({}, "json_default.json")]
)
async def test_server_output_formatter_option(option, name):
    """With output_formatter=jsonlines every request streams (a request may name another formatter)."""
    served = text_app(**option)
    served.fake.reply(Script(events=golden_events()))
    response = await post(served, {"inputs": GOLDEN_PROMPT})
    assert response.content == (GOLDEN / name).read_bytes()
    response = await post(served, {"inputs": GOLDEN_PROMPT, "parameters": {"output_formatter": "json"}})
    assert response.content == (GOLDEN / "json_default.json").read_bytes()
    response = await post(served, {"inputs": GOLDEN_PROMPT, "stream": True, "parameters": {"output_formatter": "sse"}})
    assert response.content == (GOLDEN / "sse_default.sse").read_bytes()
    if option:
        response = await post(served, {"inputs": GOLDEN_PROMPT, "parameters": {"details": True}})
        assert response.content == (GOLDEN / "jsonlines_details.jsonl").read_bytes()


# --- tgi_compat on LMI's routes ----------------------------------------------------------------------------


async def test_tgi_compat_server_formats_lmi_routes_the_tgi_way():
    served = text_app(tgi_compat=True)
    served.fake.reply(Script(events=golden_events()))
    response = await post(served, {"inputs": GOLDEN_PROMPT}, path="/predictions/tiny")
    assert response.content == (GOLDEN / "json_tgi.json").read_bytes()
    response = await post(served, {"inputs": GOLDEN_PROMPT, "stream": True}, path="/predictions/tiny")
    assert response.content == (GOLDEN / "sse_tgi.sse").read_bytes()
    response = await post(served, {"inputs": GOLDEN_PROMPT, "parameters": {"details": False}}, path="/predictions/tiny")
    assert response.content == (GOLDEN / "json_tgi_details_false.json").read_bytes()
    payload = {"inputs": GOLDEN_PROMPT, "stream": True, "parameters": {"details": False}}
    response = await post(served, payload, path="/predictions/tiny")
    assert response.content == (
        b'data: {"token": {"id": 304, "text": "Deep", "logprob": -0.05}}\n\n'
        b'data: {"token": {"id": 11157, "text": " Learning", "logprob": -1.28}}\n\n'
        b'data: {"token": {"id": 338, "text": " is", "logprob": -0.007}, "generated_text": "Deep Learning is"}\n\n'
    )
    assert_424(await post(served, {"inputs": ""}, path="/predictions/tiny"), PREFIX + EMPTY + "{'inputs': ''}")


# --- dynamic batching (rolling_batch=disable) -------------------------------------------------------------


def one_token(token_id: int, text: str) -> list[StepEvent]:
    return [StepEvent(Token(token_id, text, -0.1), finish=Finish(FinishReason.LENGTH, text, 1, "", 2))]


async def test_dynamic_batch_goldens():
    served = text_app(rolling_batch="disable", batch_size=4)
    served.fake.reply_once(Script(events=one_token(5, " there")), Script(events=one_token(6, " à")))
    response = await post(served, {"inputs": ["Hi", "Bonjour"], "parameters": {"return_full_text": False}})
    assert response.content == '[{"generated_text": " there"}, {"generated_text": " à"}]'.encode()
    served.fake.reply_once(Script(events=one_token(5, " there")), Script(events=one_token(6, " à")))
    response = await post(served, {"inputs": ["Hi", "Bonjour"]})  # the prompt comes first by default
    assert response.content == (GOLDEN / "dynamic_batch_list.json").read_bytes()
    served.fake.reply_once(Script(events=golden_events()))
    response = await post(served, {"inputs": GOLDEN_PROMPT})
    assert response.content == (GOLDEN / "dynamic_batch_str.json").read_bytes()
    assert [r.prompt for r in served.fake.requests] == ["Hi", "Bonjour", "Hi", "Bonjour", GOLDEN_PROMPT]


async def test_dynamic_batch_stream_golden():
    served = text_app(rolling_batch="disable", batch_size=1, enable_streaming=True)
    abc = [Token(1, "A", -0.1), Token(2, "B", -0.1), Token(3, "C", -0.1)]
    first = golden_events(abc, finish(text="ABC"))
    second = golden_events((Token(4, "x", -0.1),), finish(FinishReason.EOS_TOKEN, "x", 1))
    served.fake.reply_once(Script(events=first), Script(events=second))
    response = await post(served, {"inputs": ["a", "b"], "stream": True})
    assert response.content == (GOLDEN / "dynamic_batch_stream.jsonl").read_bytes()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], NOT_STRING + "<class 'list'>"),
        (["a", 1], NOT_STRING + "<class 'list'>"),
        (["a", ""], EMPTY + "{'inputs': ['a', ''], 'parameters': {}}"),
    ],
)
async def test_dynamic_batch_bad_inputs(inputs, message):
    served = text_app(rolling_batch="disable", batch_size=4)
    assert_424(await post(served, {"inputs": inputs, "parameters": {}}), PREFIX + message)


async def test_dynamic_batch_failure_is_424():
    served = text_app(rolling_batch="disable", batch_size=4)
    served.fake.reply_once(Script(text=FOX), Script(text=FOX, failure="CUDA out of memory"))
    assert_424(await post(served, {"inputs": ["a", "b"]}), "CUDA out of memory")


async def test_priority_parameter_reaches_the_engine_and_is_checked(served):
    """`parameters.priority` (vLLM's meaning, lower first) orders the engine's waiting queue."""
    r = await post(served, {"inputs": "hi", "parameters": {"max_new_tokens": 2, "priority": 7}})
    assert r.status_code == 200, r.text
    assert served.fake.requests[-1].priority == 7
    r = await post(served, {"inputs": "hi", "parameters": {"priority": "soon"}})
    assert r.status_code == 424 and "priority" in r.text
