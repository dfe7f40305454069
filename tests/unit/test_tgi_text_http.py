"""TGI's native routes over HTTP, in process, on the scripted fake engine (tests/helpers/text_app.py):
/generate, /generate_stream and POST / (bodies byte for byte, TGI's headers), validation errors (422
JSON, in-band on streams), plain-text rejections, engine errors in TGI's terms, the API key, the payload
limit, admission (429 `overloaded`), SSE keep-alive comments, client disconnects, /health, /info,
/tokenize, /chat_tokenize, /v1/models, /invocations under tgi_compat, and the golden files of
tests/golden/tgi replayed (their tokens scripted) through the whole HTTP path.

The same routes on a real server: tests/integration/test_tgi_http.py, test_tgi_limits.py (`/invocations`
under tgi_compat is checked here only)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from helpers.tensor_app import client as tensor_client
from helpers.tensor_app import tensor_app, text_model
from helpers.text_app import Script, text_app
from lmiserve import __version__
from lmiserve.core.errors import GenerationFailed, InvalidRequest, ModelNotReady, Overloaded, QueueTimeout
from lmiserve.core.events import StepEvent, Token

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tgi"
PROMPT = "Deep learning is"  # 4 tokens with BOS
FOX = " the quick brown fox jumps"
FOX_TOKENS = [(272, " the"), (496, " quick"), (508, " brown"), (473, " fox"), (475, " jumps")]
EOS = 2
KEY = "s3cret-Key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMING = ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token")


def openai_error(message: str, kind: str, code: str | None = None) -> bytes:
    """OpenAI's error object (the OpenAI routes' errors: tests/unit/test_openai_text_http.py)."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, separators=(",", ":")
    ).encode()


def dumps(obj) -> bytes:
    """serde's spelling: compact, raw UTF-8."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(*objects) -> bytes:
    return b"".join(b"data: " + dumps(o) + b"\n\n" for o in objects)


def tok(token_id: int, text: str, logprob: float = -0.5, special: bool = False) -> dict:
    return {"id": token_id, "text": text, "logprob": logprob, "special": special}


def error(message: str, kind: str) -> dict:
    return {"error": message, "error_type": kind}


@pytest.fixture
def served():
    return text_app()


async def post(served, path: str, payload=None, **kwargs):
    async with served.client() as http:
        if payload is None:
            return await http.post(path, **kwargs)
        return await http.post(path, json=payload, **kwargs)


# --- /generate -------------------------------------------------------------------------------------------


async def test_generate_details_shape_and_headers(served):
    served.fake.reply(Script(text=FOX))
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    tokens = [tok(i, t) for i, t in FOX_TOKENS]
    details = {"finish_reason": "length", "generated_tokens": 5, "seed": None, "prefill": [], "tokens": tokens}
    assert r.content == dumps({"generated_text": FOX, "details": details})
    assert (r.headers["x-generated-tokens"], r.headers["x-prompt-tokens"]) == ("5", "4")
    assert (r.headers["x-compute-characters"], r.headers["x-compute-type"]) == (str(len(PROMPT)), "cpu")
    float(r.headers["x-compute-time"])
    assert all(int(r.headers[name]) >= 0 for name in TIMING)


async def test_generate_without_details_is_only_text_and_eos_is_shown_as_its_text(served):
    served.fake.reply(Script(text=" the quick"))
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5}})
    assert r.content == b'{"generated_text":" the quick"}'
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}})
    tokens = [tok(272, " the"), tok(496, " quick"), tok(EOS, "</s>", special=True)]
    details = {"finish_reason": "eos_token", "generated_tokens": 3, "seed": None, "prefill": [], "tokens": tokens}
    assert r.content == dumps({"generated_text": " the quick", "details": details})


async def test_compat_route_is_a_one_element_list_or_the_stream(served):
    served.fake.reply(Script(text=FOX))
    params = {"max_new_tokens": 2, "details": True}
    listed = await post(served, "/", {"inputs": PROMPT, "parameters": params})
    single = await post(served, "/generate", {"inputs": PROMPT, "parameters": params})
    assert listed.status_code == 200 and listed.content == b"[" + single.content + b"]"
    streamed = await post(served, "/", {"inputs": PROMPT, "parameters": params, "stream": True})
    assert streamed.headers["content-type"] == "text/event-stream"
    last_details = {"finish_reason": "length", "generated_tokens": 2, "seed": None, "input_length": 4}
    assert streamed.content == sse(
        {"index": 1, "token": tok(272, " the"), "generated_text": None, "details": None},
        {"index": 2, "token": tok(496, " quick"), "generated_text": " the quick", "details": last_details},
    )


async def test_stream_events_and_headers(served):
    served.fake.reply(Script(text=" the quick"))
    r = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream"
    assert (r.headers["cache-control"], r.headers["x-accel-buffering"]) == ("no-cache", "no")
    assert (r.headers["x-compute-type"], r.headers["x-compute-characters"]) == ("cpu", "16")
    assert r.content == sse(
        {"index": 1, "token": tok(272, " the"), "generated_text": None, "details": None},
        {"index": 2, "token": tok(496, " quick"), "generated_text": None, "details": None},
        {"index": 3, "token": tok(EOS, "</s>", special=True), "generated_text": " the quick", "details": None},
    )


async def test_stream_equals_generate(served):
    params = {"max_new_tokens": 8, "details": True}
    whole = (await post(served, "/generate", {"inputs": PROMPT, "parameters": params})).json()
    r = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": params})
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
    assert [e["token"] for e in events] == whole["details"]["tokens"]
    assert events[-1]["generated_text"] == whole["generated_text"]
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 8, "seed": None, "input_length": 4}


async def test_stop_sequence_is_kept(served):
    served.fake.reply(Script(text=FOX))
    params = {"max_new_tokens": 12, "stop": ["ck br"], "details": True}
    body = (await post(served, "/generate", {"inputs": PROMPT, "parameters": params})).json()
    assert (body["generated_text"], body["details"]["finish_reason"]) == (" the quick br", "stop_sequence")
    assert served.fake.requests[0].params.include_stop_str_in_output is True


async def test_seed_is_echoed_when_sampling_and_reproducible(served):
    params = {"max_new_tokens": 6, "do_sample": True, "seed": 42, "details": True}
    a = (await post(served, "/generate", {"inputs": PROMPT, "parameters": params})).json()
    b = (await post(served, "/generate", {"inputs": PROMPT, "parameters": params})).json()
    assert a["details"]["seed"] == 42 and a == b
    c = (await post(served, "/generate", {"inputs": PROMPT, "parameters": {**params, "seed": 43}})).json()
    assert c["generated_text"] != a["generated_text"]


async def test_no_parameters_means_sampling_with_a_random_seed(served):
    a = (await post(served, "/generate", {"inputs": PROMPT})).json()
    b = (await post(served, "/generate", {"inputs": PROMPT})).json()
    assert a != b  # 252 sampled tokens each (the rest of the context), seeded at random
    request = served.fake.requests[0]
    assert (request.params.do_sample, request.params.seed, request.params.max_new_tokens) == (True, None, 252)


async def test_best_of_top_n_tokens_and_prefill(served):
    params = {"max_new_tokens": 3, "best_of": 2, "do_sample": True, "top_n_tokens": 2, "decoder_input_details": True}
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": params})
    details = r.json()["details"]
    assert list(details) == [
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
        "best_of_sequences",
        "top_tokens",
    ]
    (other,) = details["best_of_sequences"]
    assert list(other) == [
        "generated_text",
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
        "top_tokens",
    ]
    assert len(details["top_tokens"]) == 3 and all(len(step) == 2 for step in details["top_tokens"])
    assert details["prefill"] == [
        {"id": 1, "text": "<s>", "logprob": None},
        {"id": 487, "text": "Deep", "logprob": -1.5},
        {"id": 353, "text": " learning", "logprob": -1.5},
        {"id": 300, "text": " is", "logprob": -1.5},
    ]
    assert isinstance(details["seed"], int) and abs(other["seed"] - details["seed"]) == 1  # one seed per sequence


async def test_truncate_and_return_full_text(served):
    served.fake.reply(Script(text=FOX))
    params = {"max_new_tokens": 2, "truncate": 2, "return_full_text": True}
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": params})
    assert r.headers["x-prompt-tokens"] == "2" and served.fake.encoded == [[353, 300]]
    assert r.content == dumps({"generated_text": PROMPT + " the quick"})


async def test_max_new_tokens_defaults_to_the_rest_of_the_context(served):
    details = (await post(served, "/generate", {"inputs": PROMPT, "parameters": {"details": True}})).json()["details"]
    assert (details["generated_tokens"], details["finish_reason"]) == (256 - 4, "length")


# --- validation and rejections ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"truncate": 300}, "`truncate` must be strictly positive and less than 255. Given: 300"),
        (
            {"max_new_tokens": 1000},
            "`inputs` tokens + `max_new_tokens` must be <= 256. Given: 4 `inputs` tokens and 1000 `max_new_tokens`",
        ),
    ],
)
async def test_validation_errors(served, params, message):
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": params})
    assert (r.status_code, r.headers["content-type"]) == (422, "application/json")
    assert r.content == dumps(error(f"Input validation error: {message}", "validation"))
    streamed = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": params})
    assert (streamed.status_code, streamed.headers["content-type"]) == (200, "text/event-stream")  # in-band
    assert streamed.content == sse(error(f"Input validation error: {message}", "validation"))
    assert served.fake.requests == []


ADAPTER_ERROR = "`adapter_id` names adapter `my-lora`, which is not served (this model serves no LoRA adapters)"


async def test_an_adapter_that_is_not_served_is_not_found(served):
    """TGI itself answers an unknown adapter_id with the base model; lmiserve answers 404 ``not_found``,
    on the stream too (checked before it starts: a response, not an in-band event). Served adapters:
    tests/unit/test_adapter_selection_http.py."""
    payload = {"inputs": PROMPT, "parameters": {"adapter_id": "my-lora", "max_new_tokens": 2}}
    for path in ("/generate", "/generate_stream", "/"):
        r = await post(served, path, payload)
        assert (r.status_code, r.headers["content-type"]) == (404, "application/json"), path
        assert r.content == dumps(error(ADAPTER_ERROR, "not_found")), path
    assert served.fake.requests == []
    for base in (None, "", "tiny", "tgi"):  # no adapter, or the base model itself
        r = await post(served, "/generate", {**payload, "parameters": {"adapter_id": base, "max_new_tokens": 2}})
        assert r.status_code == 200, base
        assert served.fake.requests[-1].adapter is None


async def test_empty_and_too_long_inputs(served):
    r = await post(served, "/generate", {"inputs": ""})
    assert r.content == dumps(error("Input validation error: `inputs` cannot be empty", "validation"))
    r = await post(served, "/generate", {"inputs": "word " * 300, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 422 and r.json()["error"].startswith("Input validation error: `inputs` tokens + ")


async def test_streaming_only_errors_are_in_band(served):
    r = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}})
    assert r.content == (GOLDEN / "stream_validation_error.sse").read_bytes()
    r = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert r.content == sse(
        error("Input validation error: `best_of` != 1 is not supported when streaming tokens", "validation")
    )


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_plain_text_rejections(served, path):
    cases = [
        (
            {"content": b'{"inputs": "x"}', "headers": {"content-type": "text/plain"}},
            415,
            b"Expected request with `Content-Type: application/json`",
        ),
        (
            {"content": b'{"inputs": ', "headers": {"content-type": "application/json"}},
            400,
            b"Failed to parse the request body as JSON: Expecting value: line 1 column 12 (char 11)",
        ),
        (
            {"json": {"input": "x"}},
            422,
            b"Failed to deserialize the JSON body into the target type: inputs: Field required",
        ),
        (
            {"json": {"inputs": "x", "parameters": {"seed": -1}}},
            422,
            b"Failed to deserialize the JSON body into the target type: parameters.seed: Input should be greater than or equal to 0",
        ),
    ]
    for kwargs, status, body in cases:
        r = await post(served, path, **kwargs)
        assert (r.status_code, r.headers["content-type"], r.content) == (status, "text/plain; charset=utf-8", body)


async def test_lenient_stop_null_and_unknown_keys(served):
    payload = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "stop": None, "adapter_id": None}, "extra": 1}
    assert (await post(served, "/generate", payload)).status_code == 200


# --- engine errors in TGI's terms ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [
        (Overloaded("Worker queue capacity exceeded"), 429, error("Model is overloaded", "overloaded")),
        (
            QueueTimeout("Time out in: 1.5"),
            424,
            error("Request failed during generation: Time out in: 1.5", "generation"),
        ),
        (InvalidRequest("bad"), 422, error("Input validation error: bad", "validation")),
        (
            ModelNotReady("The server is shutting down"),
            424,
            error("Request failed during generation: The server is shutting down", "generation"),
        ),
    ],
    ids=["overloaded", "queue-timeout", "invalid", "stopped"],
)
async def test_engine_errors(served, exc, status, body):
    served.fake.reply(Script(error=exc))
    r = await post(served, "/generate", {"inputs": PROMPT})
    assert (r.status_code, r.content) == (status, dumps(body))
    r = await post(served, "/generate_stream", {"inputs": PROMPT})
    assert (r.status_code, r.content) == (200, sse(body))


async def test_failures_during_generation(served):
    served.fake.reply(Script(text=FOX, failure="CUDA out of memory", failure_after=1))
    failed = error("Request failed during generation: CUDA out of memory", "generation")
    r = await post(served, "/generate", {"inputs": PROMPT})
    assert (r.status_code, r.content) == (424, dumps(failed))
    r = await post(served, "/generate_stream", {"inputs": PROMPT})
    first = {"index": 1, "token": tok(272, " the"), "generated_text": None, "details": None}
    assert (r.status_code, r.content) == (200, sse(first, failed))
    served.fake.reply(Script(events=[StepEvent(Token(272, " the", -0.5))]))  # ends without a final event
    r = await post(served, "/generate", {"inputs": PROMPT})
    assert (r.status_code, r.content) == (500, dumps(error("Incomplete generation", "incomplete_generation")))
    r = await post(served, "/generate_stream", {"inputs": PROMPT})
    assert r.content == sse(first, error("Incomplete generation stream", "incomplete_generation_stream"))
    served.fake.reply(Script(text=FOX, error=GenerationFailed("lost"), error_after=1))
    r = await post(served, "/generate_stream", {"inputs": PROMPT})
    assert r.content == sse(first, error("Request failed during generation: lost", "generation"))


async def test_grammar_errors_are_answered_before_the_stream(served):
    grammar = {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"grammar": grammar}})
    assert r.status_code == 422 and r.json()["error"].startswith("Input validation error: invalid JSON schema")
    r = await post(served, "/generate_stream", {"inputs": PROMPT, "parameters": {"grammar": grammar}})
    assert r.status_code == 200 and r.text.startswith('data: {"error":"Input validation error: invalid JSON schema')
    assert served.fake.requests == [] and len(served.fake.prepared) == 2


async def test_grammar_constrains_the_output(served):
    served.fake.reply(Script(text='{"a":12}', eos=False))
    grammar = {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    params = {"grammar": grammar, "max_new_tokens": 20, "details": True}
    body = (await post(served, "/generate", {"inputs": PROMPT, "parameters": params})).json()
    assert (body["generated_text"], body["details"]["finish_reason"]) == ('{"a":12}', "eos_token")
    served.fake.reply(Script(text='{"b":1}'))
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": params})
    assert r.status_code == 424 and "does not follow the grammar" in r.json()["error"]


async def test_model_not_ready():
    served = text_app(status="PENDING")
    unhealthy = dumps(error("unhealthy", "healthcheck"))
    for path in ("/generate", "/generate_stream", "/"):
        r = await post(served, path, {"inputs": PROMPT})
        assert (r.status_code, r.content) == (503, dumps(error("Model tiny is loading", "unhealthy"))), path
    async with served.client() as http:
        for path in ("/health", "/", "/info"):
            r = await http.get(path)
            assert (r.status_code, r.content) == (503, unhealthy), path


# --- the client goes away; admission; keep-alive --------------------------------------------------------------


async def test_disconnect_aborts_and_frees_the_slot():
    served = text_app(max_concurrent_requests=1)
    served.fake.reply_once(Script(text=FOX, hold_after=1))
    async with served.exchange("/generate_stream", {"inputs": PROMPT}) as ex:
        first = await ex.chunk()
        assert first == sse({"index": 1, "token": tok(272, " the"), "generated_text": None, "details": None})
        r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert (r.status_code, r.content) == (429, dumps(error("Model is overloaded", "overloaded")))
        await ex.disconnect()
    assert served.fake.aborted == [served.fake.requests[0].request_id]
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200


async def test_overload_keepalive_and_release():
    served = text_app(max_concurrent_requests=2, sse_keepalive_interval=0.05)
    served.fake.reply_once(Script(hold_after=0), Script(hold_after=0))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    async with (
        served.exchange("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 3}}) as tgi,
        served.exchange("/v1/chat/completions", chat) as openai,
    ):
        # both wait for the engine: keep-alive comments only
        assert await tgi.chunk() == b":\n\n" and await openai.chunk() == b":\n\n"
        async with served.client() as http:
            assert (await http.get("/models/tiny")).json()[0]["models"][0]["requestInQueue"] == 2
            r = await http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
            assert (r.status_code, r.content) == (429, dumps(error("Model is overloaded", "overloaded")))
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert (r.status_code, r.content) == (429, openai_error("Model is overloaded", "rate_limit_error"))
            r = await http.post("/generate_stream", json={"inputs": "x"})
            assert (r.status_code, r.content) == (
                200,
                b'data: {"error":"Model is overloaded","error_type":"overloaded"}\n\n',
            )
            r = await http.post("/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 200  # LMI's routes are not counted
        await openai.disconnect()  # the chat stream's client goes away: its sequence is aborted
        assert served.fake.aborted == [served.fake.requests[1].request_id]
        served.fake.release()
        body = await tgi.finish()
        assert body.startswith(b":\n\n") and body.endswith(b'"details":null}\n\n') and body.count(b"data: ") == 3
    r = await post(served, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200


# --- the API key and the payload limit ---------------------------------------------------------------------------


@pytest.fixture
def keyed():
    return text_app(api_key=KEY, payload_limit=1000, max_context=4096)


@pytest.mark.parametrize(
    "path",
    ["/generate", "/generate_stream", "/", "/tokenize", "/v1/chat/completions", "/v1/completions", "/invocations"],
)
async def test_generation_routes_need_the_key(keyed, path):
    expected: tuple = (401, b"", None)  # TGI's and LMI's bare 401
    if path.startswith("/v1/"):  # OpenAI's error object
        body = openai_error("missing or wrong API key", "authentication_error", code="invalid_api_key")
        expected = (401, body, "application/json")
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = await post(keyed, path, {"inputs": "x", "messages": [], "prompt": "x"}, headers=headers)
        assert (r.status_code, r.content, r.headers.get("content-type")) == expected, (path, headers)
    assert keyed.fake.requests == []


async def test_the_key_is_compared_case_insensitively_and_lmi_routes_need_it(keyed):
    payload = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    r = await post(keyed, "/generate", payload, headers={"Authorization": f"bearer {KEY.upper()}"})
    assert r.status_code == 200
    assert (await post(keyed, "/predictions/tiny", payload)).status_code == 401
    assert (await post(keyed, "/predictions/tiny", payload, headers=AUTH)).status_code == 200
    assert (await post(keyed, "/invocations", payload, headers=AUTH)).status_code == 200
    assert (await post(keyed, "/v2/models/tiny/generate", {"text_input": "x"})).status_code == 401


async def test_only_probes_are_open(keyed):
    async with keyed.client() as http:
        for path in ("/health", "/", "/ping"):
            assert (await http.get(path)).status_code == 200, path
        for path in ("/info", "/v1/models", "/models"):
            assert (await http.get(path)).status_code == 401, path
            assert (await http.get(path, headers=AUTH)).status_code == 200, path
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post("/chat_tokenize", json=chat)).status_code == 401
        assert (await http.post("/chat_tokenize", json=chat, headers=AUTH)).status_code == 200


async def test_payload_limit(keyed):
    big = {"inputs": "x" * 2000, "parameters": {"max_new_tokens": 2}}
    message = "Failed to buffer the request body: length limit exceeded"
    too_large = (413, message.encode())
    openai_too_large = (413, openai_error(message, "invalid_request_error"))  # OpenAI's routes: its error object
    for path, expected in (("/generate", too_large), ("/v1/completions", openai_too_large)):
        r = await post(keyed, path, big, headers=AUTH)
        assert (r.status_code, r.content) == expected, path
    assert (await post(keyed, "/invocations", big, headers=AUTH)).status_code == 200  # LMI has no body limit

    async def chunked():  # no Content-Length: counted while it arrives
        for _ in range(64):
            yield b"x" * 1024

    headers = {**AUTH, "Content-Type": "application/json"}
    for path, expected in (("/generate", too_large), ("/v1/chat/completions", openai_too_large)):
        r = await post(keyed, path, content=chunked(), headers=headers)
        assert (r.status_code, r.content) == expected, path


# --- health, info, models, tokenize ------------------------------------------------------------------------------


async def test_health_info_and_models(served):
    async with served.client() as http:
        for path in ("/health", "/"):
            r = await http.get(path)
            assert (r.status_code, r.content) == (200, b""), path
        assert (await http.get("/ping")).json() == {"tiny": {"status": "Healthy"}}
        info = (await http.get("/info")).json()
        models = await http.get("/v1/models")
    assert list(info.items()) == [  # TGI 3.x fields in wire order, then the legacy 2.x ones, then lmiserve's
        ("model_id", "tiny"),
        ("model_sha", None),
        ("model_pipeline_tag", "text-generation"),
        ("max_concurrent_requests", 128),
        ("max_best_of", 2),
        ("max_stop_sequences", 4),
        ("max_input_tokens", 255),
        ("max_total_tokens", 256),
        ("validation_workers", 1),
        ("max_client_batch_size", 4),
        ("router", "lmiserve"),
        ("version", __version__),
        ("sha", None),
        ("docker_label", None),
        ("model_dtype", "torch.float32"),
        ("model_device_type", "cpu"),
        ("max_input_length", 255),
        ("waiting_served_ratio", 0.0),
        ("max_batch_total_tokens", None),
        ("max_waiting_tokens", 0),
        ("max_batch_size", 32),
        ("prefix_caching", False),  # the fake engine has no prefix cache
        ("prefix_cache_size", 0),
        ("prefix_cache_tokens", 0),
        ("speculative_decoding", None),  # off
        ("tool_call_parser", "json"),  # the tiny tokenizer's template has no tool format
    ]
    assert models.content == (
        b'{"object":"list","data":[{"id":"tiny","object":"model","created":0,"owned_by":"tiny",'
        b'"root":"tiny","parent":null,"max_model_len":256}]}'
    )


async def test_info_follows_the_limits():
    served = text_app(max_input_len=64, max_best_of=4, max_concurrent_requests=3)
    async with served.client() as http:
        info = (await http.get("/info")).json()
    assert (info["max_input_tokens"], info["max_total_tokens"], info["max_best_of"]) == (64, 256, 4)
    assert info["max_concurrent_requests"] == 3


async def test_tokenize_byte_offsets(served):
    r = await post(served, "/tokenize", {"inputs": "héllo world"})
    tokens = r.json()
    assert tokens[0] == {"id": 1, "text": "", "start": 0, "stop": 0}  # BOS added
    raw = "héllo world".encode()
    assert all(t["text"] == raw[t["start"] : t["stop"]].decode(errors="replace") for t in tokens[1:])
    assert tokens[-1]["stop"] == len(raw)
    assert [t["id"] for t in tokens] == served.fake.tokenizer("héllo world")["input_ids"]


async def test_chat_tokenize(served):
    r = await post(served, "/chat_tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    body = r.json()
    assert body["templated_text"] == "<|user|>hi</s><|assistant|>"
    assert "".join(t["text"] for t in body["tokenize_response"]) == body["templated_text"]
    assert [t["id"] for t in body["tokenize_response"]][:1] == [5]  # <|user|>, no BOS


# --- LMI's side is untouched; /invocations under tgi_compat ------------------------------------------------------


async def test_lmi_invocations_and_errors_unchanged(served):
    served.fake.reply(Script(text=FOX))
    async with served.client() as http:
        r = await http.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.content == b'{"generated_text": " the quick"}'
        missing = await http.get("/no/such/route")
        wrong = await http.get("/generate")
    assert (missing.status_code, missing.json()["type"]) == (404, "ResourceNotFoundException")
    assert (wrong.status_code, wrong.json()["type"]) == (405, "MethodNotAllowedException")


@pytest.mark.parametrize(
    "payload",
    [
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}},
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}, "stream": True},
        {"inputs": PROMPT, "parameters": {"top_p": 1.0}},
        {"inputs": PROMPT, "parameters": {"top_p": 1.0}, "stream": True},
        {"inputs": 5},
    ],
    ids=["details", "plain", "stream", "validation", "stream-validation", "bad-body"],
)
async def test_invocations_is_the_tgi_compat_route(payload):
    served = text_app(tgi_compat=True)
    served.fake.reply(Script(text=FOX))
    a = await post(served, "/invocations", payload)
    b = await post(served, "/", payload)
    assert (a.status_code, a.content) == (b.status_code, b.content)
    timing = {*TIMING, "x-compute-time", "x-request-id"}
    assert {k: v for k, v in a.headers.items() if k not in timing} == {
        k: v for k, v in b.headers.items() if k not in timing
    }


async def test_tgi_compat_invocations_keeps_lmi_formatters_and_chat():
    served = text_app(tgi_compat=True)
    served.fake.reply(Script(text=FOX))
    body = (await post(served, "/invocations", {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})).content
    assert body == b'[{"generated_text":" the quick"}]'
    payload = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2, "output_formatter": "jsonlines"}}
    r = await post(served, "/invocations", payload)
    assert r.headers["content-type"] == "application/jsonlines"
    assert r.content == (
        b'{"token": {"id": 272, "text": " the", "logprob": -0.5}}\n'
        b'{"token": {"id": 496, "text": " quick", "logprob": -0.5}, "generated_text": " the quick", '
        b'"details": {"finish_reason": "length", "generated_tokens": 2, "inputs": "Deep learning is"}}\n'
    )
    r = await post(served, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["object"] == "chat.completion"


async def test_huggingface_hub_payload():
    """What InferenceClient.text_generation(prompt, details=True) sends to a tgi_compat server."""
    served = text_app(tgi_compat=True)
    params = {
        "details": True,
        "decoder_input_details": False,
        "do_sample": False,
        "max_new_tokens": 4,
        "return_full_text": False,
        "stop": [],
        "watermark": False,
    }
    r = await post(served, "/invocations", {"inputs": PROMPT, "parameters": params, "stream": False})
    details = r.json()[0]["details"]
    assert (details["finish_reason"], details["generated_tokens"]) == ("length", 4)


# --- the golden files (their tokens scripted) through the whole HTTP path -------------------------------------------


def scripted(name: str) -> Script:
    """The tokens, logprobs, top tokens and prompt logprobs a golden file shows, as a script."""
    raw = (GOLDEN / name).read_text()
    if name.endswith(".sse"):
        events = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n") if e]
        tokens = [e["token"] for e in events]
        tops = [[(t["id"], t["logprob"]) for t in e.get("top_tokens", [])] for e in events]
        prefill = None
    else:
        body = json.loads(raw)
        details = (body[0] if isinstance(body, list) else body)["details"]
        tokens = details["tokens"]
        tops = [[(t["id"], t["logprob"]) for t in step] for step in details.get("top_tokens", [])] or None
        prefill = [t["logprob"] for t in details["prefill"]] or None
    return Script(
        ids=[t["id"] for t in tokens],
        logprobs=[t["logprob"] for t in tokens],
        top=tops or None,
        prompt_logprobs=prefill,
        eos=False,
    )


GOLDEN_CASES = {  # golden file: (route, parameters, the golden file whose tokens are generated)
    "generate_default.json": ("/generate", {"max_new_tokens": 5}, "generate_details.json"),
    "generate_details.json": ("/generate", {"max_new_tokens": 5, "details": True}, "generate_details.json"),
    "generate_prefill_top_tokens.json": (
        "/generate",
        {"max_new_tokens": 3, "decoder_input_details": True, "top_n_tokens": 2},
        "generate_prefill_top_tokens.json",
    ),
    "generate_return_full_text_stop.json": (
        "/generate",
        {"max_new_tokens": 8, "details": True, "return_full_text": True, "stop": ["J"]},
        "generate_return_full_text_stop.json",
    ),
    "compat_list.json": ("/", {"max_new_tokens": 4, "details": True}, "compat_list.json"),
    "stream_default.sse": ("/generate_stream", {"max_new_tokens": 4}, "stream_default.sse"),
    "stream_details_top_tokens.sse": (
        "/generate_stream",
        {"max_new_tokens": 4, "details": True, "top_n_tokens": 2},
        "stream_details_top_tokens.sse",
    ),
    "stream_validation_error.sse": (
        "/generate_stream",
        {"max_new_tokens": 4, "decoder_input_details": True},
        "stream_default.sse",
    ),
    "error_validation.json": ("/generate", {"max_new_tokens": 1000}, "generate_details.json"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
async def test_golden_over_http(served, name):
    route, params, source = GOLDEN_CASES[name]
    served.fake.reply(scripted(source))
    r = await post(served, route, {"inputs": PROMPT, "parameters": params})
    assert r.content == (GOLDEN / name).read_bytes()


@pytest.mark.parametrize("route", ["/generate", "/generate_stream", "/"])
async def test_a_server_without_a_text_model_answers_404_in_tgi_shape(route, caplog):
    app = tensor_app({"emb": text_model()})
    async with tensor_client(app) as http:
        r = await http.post(route, json={"inputs": "Hi"})
    body = {"error": "No text-generation model is loaded: this route needs an LLM.", "error_type": "not_found"}
    assert (r.status_code, r.headers["content-type"], r.content) == (404, "application/json", dumps(body))
    assert [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR] == []


async def test_priority_reaches_the_engine_and_is_checked(served):
    """vLLM's `priority` extension (lower is admitted first) on TGI's routes: handed to the engine; a
    value out of 32-bit range is TGI's 422 deserialization error (text, as TGI's own)."""
    r = await post(served, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "priority": -3}})
    assert r.status_code == 200, r.text
    assert served.fake.requests[-1].priority == -3
    r = await post(served, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert served.fake.requests[-1].priority == 0
    r = await post(served, "/generate", {"inputs": "hi", "parameters": {"priority": 2**40}})
    assert r.status_code == 422 and b"parameters.priority" in r.content
