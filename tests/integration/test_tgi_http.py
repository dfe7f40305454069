"""TGI native routes over real HTTP on the tiny model: shapes, headers, validation messages (422 JSON,
in-band on streams), TGI's plain-text rejections, health, info, tokenize, and the LMI routes and error
shapes untouched."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

PROMPT = "Deep learning is"
TINY_CONTEXT = 256


@pytest.fixture(scope="module")
def client(server_pool, tiny_model_dir) -> Iterator[httpx.Client]:
    url = server_pool.url(["--model-id", str(tiny_model_dir)])  # shared: the tiny model's defaults
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        yield c


def sse_events(text: str) -> list[dict]:
    """Strict native SSE: `data: <compact json>\\n\\n` only, never [DONE]."""
    assert text.endswith("\n\n")
    out = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        assert data != "[DONE]"
        obj = json.loads(data)
        assert data == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        out.append(obj)
    return out


def compact(raw: str) -> bool:
    return raw == json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False)


# --- /generate ------------------------------------------------------------------------------------------


def test_generate_details_shape_and_headers(client):
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json" and compact(r.text)
    body = r.json()
    assert list(body) == ["generated_text", "details"]
    details = body["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert details["seed"] is None and details["prefill"] == [] and details["generated_tokens"] == 5
    assert all(list(t) == ["id", "text", "logprob", "special"] for t in details["tokens"])
    assert r.headers["x-generated-tokens"] == "5"
    assert r.headers["x-prompt-tokens"] == str(len(client.post("/tokenize", json={"inputs": PROMPT}).json()))
    assert r.headers["x-compute-characters"] == str(len(PROMPT))
    assert r.headers["x-compute-type"] == "cpu"
    float(r.headers["x-compute-time"])
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time", "x-time-per-token"):
        assert int(r.headers[name]) >= 0, name


def test_generate_without_details_is_only_text(client):
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert list(r.json()) == ["generated_text"]


def test_compat_route_is_a_one_element_list_or_the_stream(client):
    params = {"max_new_tokens": 4, "details": True}
    listed = client.post("/", json={"inputs": PROMPT, "parameters": params})
    single = client.post("/generate", json={"inputs": PROMPT, "parameters": params})
    assert listed.status_code == 200 and isinstance(listed.json(), list) and len(listed.json()) == 1
    assert listed.json()[0] == single.json()
    streamed = client.post("/", json={"inputs": PROMPT, "parameters": params, "stream": True})
    assert streamed.headers["content-type"] == "text/event-stream"
    assert sse_events(streamed.text)[-1]["generated_text"] == single.json()["generated_text"]


def test_stream_events(client):
    r = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}})
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    events = sse_events(r.text)
    assert [e["index"] for e in events] == list(range(1, 7))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == 6
    assert last["details"]["seed"] is None and isinstance(last["details"]["input_length"], int)
    assert "".join(e["token"]["text"] for e in events) == last["generated_text"]


def test_stream_equals_generate(client):
    params = {"max_new_tokens": 8, "details": True}
    whole = client.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
    events = sse_events(client.post("/generate_stream", json={"inputs": PROMPT, "parameters": params}).text)
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert events[-1]["generated_text"] == whole["generated_text"]


def test_stop_sequence_is_kept(client):
    full = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}}).json()[
        "generated_text"
    ]
    stop = full[len(full) // 2 :][:2]
    r = client.post(
        "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "stop": [stop], "details": True}}
    )
    body = r.json()
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"].endswith(stop) and full.startswith(body["generated_text"])


def test_seed_is_echoed_when_sampling_and_reproducible(client):
    params = {"max_new_tokens": 6, "do_sample": True, "seed": 42, "details": True}
    a = client.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
    b = client.post("/generate", json={"inputs": PROMPT, "parameters": params}).json()
    assert a["details"]["seed"] == 42 and a["generated_text"] == b["generated_text"]


def test_best_of_top_n_tokens_and_prefill(no_eos_server):
    # TGI forbids a seed with best_of > 1, so the sampled tokens are random: on a model that cannot
    # generate EOS every sequence has exactly max_new_tokens tokens
    params = {"max_new_tokens": 3, "best_of": 2, "do_sample": True, "top_n_tokens": 2, "decoder_input_details": True}
    response = no_eos_server.post({"inputs": PROMPT, "parameters": params}, path="/generate")
    details = response.json()["details"]
    assert len(details["best_of_sequences"]) == 1
    assert len(details["top_tokens"]) == 3 and all(len(step) == 2 for step in details["top_tokens"])
    assert details["prefill"][0]["logprob"] is None and len(details["prefill"]) >= 2
    assert isinstance(details["seed"], int)


def test_truncate_and_return_full_text(client):
    r = client.post(
        "/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "truncate": 2, "return_full_text": True}},
    )
    assert r.headers["x-prompt-tokens"] == "2"
    assert r.json()["generated_text"].startswith(PROMPT)


def test_max_new_tokens_defaults_to_the_rest_of_the_context(client):
    details = client.post("/generate", json={"inputs": PROMPT, "parameters": {"details": True}}).json()["details"]
    used = details["generated_tokens"] + len(client.post("/tokenize", json={"inputs": PROMPT}).json())
    assert used == TINY_CONTEXT or details["finish_reason"] == "eos_token"


# --- validation and rejections ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, message",
    [
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        (
            {"max_new_tokens": 1000},
            "`inputs` tokens + `max_new_tokens` must be <= 256. Given: 4 `inputs` tokens and 1000 `max_new_tokens`",
        ),
    ],
)
def test_validation_errors(client, params, message):
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": params})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/json"
    assert r.text == json.dumps(
        {"error": f"Input validation error: {message}", "error_type": "validation"}, separators=(",", ":")
    )
    streamed = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": params})
    assert streamed.status_code == 200  # in-band once the stream route runs
    assert sse_events(streamed.text) == [{"error": f"Input validation error: {message}", "error_type": "validation"}]


def test_streaming_only_errors_are_in_band(client):
    r = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"decoder_input_details": True}})
    assert sse_events(r.text) == [
        {
            "error": "Input validation error: `decoder_input_details` == true is not supported when streaming tokens",
            "error_type": "validation",
        }
    ]


def test_plain_text_rejections(client):
    r = client.post("/generate", content=b'{"inputs": "x"}', headers={"content-type": "text/plain"})
    assert (r.status_code, r.text) == (415, "Expected request with `Content-Type: application/json`")
    r = client.post("/generate", content=b'{"inputs": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.text.startswith("Failed to parse the request body as JSON: ")
    r = client.post("/generate", json={"input": "x"})
    assert r.status_code == 422 and r.text.startswith("Failed to deserialize the JSON body into the target type: ")
    r = client.post("/generate", json={"inputs": "x", "parameters": {"seed": -1}})
    assert r.status_code == 422 and "seed" in r.text


def test_lenient_stop_null(client):
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "stop": None}})
    assert r.status_code == 200


# --- health, info, tokenize ------------------------------------------------------------------------------


def test_health_routes(client):
    for path in ("/health", "/"):
        r = client.get(path)
        assert (r.status_code, r.content) == (200, b""), path
    assert client.get("/ping").json() == {client.get("/v1/models").json()["data"][0]["id"]: {"status": "Healthy"}}


def test_info(client):
    info = client.get("/info").json()
    assert list(info)[:14] == [
        "model_id",
        "model_sha",
        "model_pipeline_tag",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "validation_workers",
        "max_client_batch_size",
        "router",
        "version",
        "sha",
        "docker_label",
    ]
    assert (info["max_total_tokens"], info["max_input_tokens"], info["max_input_length"]) == (256, 255, 255)
    assert (info["max_concurrent_requests"], info["max_best_of"], info["max_stop_sequences"]) == (128, 2, 4)
    assert info["model_dtype"] == "torch.float32" and info["model_device_type"] == "cpu"


def test_models_list(client):
    body = client.get("/v1/models").json()
    name = body["data"][0]["id"]
    card = {"id": name, "object": "model", "created": 0, "owned_by": name, "root": name, "parent": None}
    assert body == {"object": "list", "data": [{**card, "max_model_len": 256}]}


def test_vllm_tokenize_and_detokenize(client):
    """vLLM's shapes on the real tokenizer: /tokenize's prompt and messages, /detokenize back."""
    tokens = client.post("/tokenize", json={"inputs": "héllo world"}).json()  # TGI's
    r = client.post("/tokenize", json={"prompt": "héllo world"})
    assert r.json() == {
        "count": len(tokens),
        "max_model_len": 256,
        "tokens": [t["id"] for t in tokens],
        "token_strs": None,
    }
    r = client.post("/detokenize", json={"tokens": r.json()["tokens"][1:]})  # without BOS
    assert r.json() == {"prompt": "héllo world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 1
    r = client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_byte_offsets(client):
    text = "héllo world"
    tokens = client.post("/tokenize", json={"inputs": text}).json()
    assert tokens[0]["text"] == "" and tokens[0]["start"] == tokens[0]["stop"] == 0  # BOS added
    raw = text.encode()
    for token in tokens[1:]:
        assert set(token) == {"id", "text", "start", "stop"}
        assert token["text"] == raw[token["start"] : token["stop"]].decode(errors="replace")
    assert tokens[-1]["stop"] == len(raw)


def test_chat_tokenize(client):
    body = client.post("/chat_tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["templated_text"] == "<|user|>hi</s><|assistant|>"
    assert "".join(t["text"] for t in body["tokenize_response"]) == body["templated_text"]


# --- the LMI side is untouched ---------------------------------------------------------------------------


def test_lmi_invocations_and_errors_unchanged(client):
    r = client.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and list(r.json()) == ["generated_text"] and not compact(r.text)
    missing = client.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["type"] == "ResourceNotFoundException"
    wrong = client.get("/generate")
    assert wrong.status_code == 405 and wrong.json()["type"] == "MethodNotAllowedException"
