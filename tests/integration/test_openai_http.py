"""OpenAI-compatible routes over real HTTP on the tiny model and the /invocations dispatch
of `messages` and `prompt` bodies."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

MESSAGES = [{"role": "user", "content": "What is deep learning?"}]


@pytest.fixture(scope="module")
def client(server_pool, tiny_model_dir) -> Iterator[httpx.Client]:
    url = server_pool.url(["--model-id", str(tiny_model_dir)])  # shared: the tiny model's defaults
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        yield c


def openai_sse(text: str) -> list[dict]:
    """`data: <json>` events ending with exactly one `data: [DONE]`."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", text[-200:]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]


def test_chat_completion(client):
    r = client.post(
        "/v1/chat/completions", json={"model": "tgi", "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body)[:5] == ["object", "id", "created", "model", "system_fingerprint"]
    assert body["object"] == "chat.completion" and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["model"] == client.get("/v1/models").json()["data"][0]["id"]  # "tgi" -> served id
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    assert r.headers["x-generated-tokens"] == "5"


def test_chat_greedy_is_deterministic_and_matches_the_stream(client):
    payload = {"messages": MESSAGES, "max_completion_tokens": 6, "temperature": 0}
    whole = client.post("/v1/chat/completions", json=payload).json()
    again = client.post("/v1/chat/completions", json=payload).json()
    assert whole["choices"] == again["choices"]
    r = client.post("/v1/chat/completions", json={**payload, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"] == "text/event-stream"
    chunks = openai_sse(r.text)
    tokens, usage = chunks[:-1], chunks[-1]
    assert all(c["choices"][0]["delta"]["role"] == "assistant" and c["usage"] is None for c in tokens)
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 5 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_chat_logprobs_and_seeded_sampling(client):
    payload = {"messages": MESSAGES, "max_tokens": 3, "seed": 5, "logprobs": True, "top_logprobs": 2}
    a = client.post("/v1/chat/completions", json=payload).json()
    b = client.post("/v1/chat/completions", json=payload).json()
    assert a["choices"] == b["choices"]
    content = a["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)


def test_chat_n_choices(client):
    # unseeded: ignore_eos so that both choices have max_tokens tokens
    body = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 3, "n": 2, "temperature": 0.8, "ignore_eos": True},
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_stream_interleaved_on_the_real_engine(client, route):
    first = {"messages": MESSAGES} if route.endswith("chat/completions") else {"prompt": "Deep learning is"}
    payload = {**first, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True, "stream": True}
    events = [e for e in openai_sse(client.post(route, json=payload).text) if e["choices"]]
    order = [e["choices"][0]["index"] for e in events]
    assert sorted(order) == [0] * 6 + [1] * 6
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 streams while choice 0 does


def test_roles_and_adapters_are_refused(client):
    """A server without LoRA adapters: naming one is each protocol's 404 (never the base model's answer)."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = client.post("/v1/chat/completions", json={"model": "tiny-lora", "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "tiny-lora"}})
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    r = client.post("/invocations", json={"inputs": "Hi", "adapters": "tiny-lora"})
    assert r.status_code == 404 and r.json()["code"] == 404 and "tiny-lora" in r.json()["error"]


def test_chat_errors(client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "top_p": 1.5})
    assert r.json() == {
        "error": {
            "message": "`top_p` must be in (0, 1], got 1.5",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Tool error: ")
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert (r.status_code, r.headers["content-type"]) == (400, "application/json")
    assert r.json()["error"]["message"].startswith("Failed to deserialize")
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5000, "stream": True})
    assert r.status_code == 400  # validated before the stream starts
    r = client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MESSAGES})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def test_chat_accepts_openai_top_p_default_and_null_options(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "top_p": 1.0, "stop": None, "stream_options": None},
    )
    assert r.status_code == 200, r.text


def test_completions(client):
    r = client.post(
        "/v1/completions", json={"prompt": ["Deep learning is", "Hello"], "max_tokens": 3, "temperature": 0}
    )
    body = r.json()
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 6
    single = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}).json()
    assert single["choices"][0]["text"] == body["choices"][1]["text"]


def test_completions_echo_and_logprobs(client):
    body = client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    ).json()
    choice = body["choices"][0]
    assert choice["text"].startswith("Hello")
    assert choice["logprobs"]["token_logprobs"][0] is None  # the first prompt token has none


def test_completions_stream(client):
    payload = {"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0, "stream": True}
    events = openai_sse(client.post("/v1/completions", json=payload).text)
    assert len(events) == 6 and not any("usage" in e for e in events)  # only include_usage asks for it
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert [e["choices"][0]["finish_reason"] for e in mine] == [None, None, "length"]
    whole = client.post("/v1/completions", json={**payload, "stream": False}).json()
    r = client.post("/v1/completions", json={**payload, "stream_options": {"include_usage": True}})
    events = openai_sse(r.text)
    assert len(events) == 7 and events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_completions_errors(client):
    def invalid(message: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}

    r = client.post("/v1/completions", json={"prompt": []})
    assert (r.status_code, r.json()) == (
        400,
        invalid("Empty array detected. Do not use an empty array for the prompt."),
    )
    r = client.post("/v1/completions", json={"prompt": "a", "suffix": None})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400,
        "Suffix is not supported and can be achieved by preprocessing the prompt.",
    )
    r = client.post("/v1/completions", json={"prompt": ["a"] * 32, "max_tokens": 1})  # lm-eval's batches
    assert r.status_code == 200 and len(r.json()["choices"]) == 32
    r = client.post("/v1/completions", json={"prompt": ["a"] * 33})
    assert (r.status_code, r.json()) == (
        400,
        invalid(
            "Number of prompts exceeds the maximum allowed batch size of 32 "
            "(the server's max_rolling_batch_size, vLLM's max_num_seqs)"
        ),
    )
    r = client.post("/v1/completions", json={"prompt": "a", "stream_options": {"include_usage": True}})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        400,
        "Stream options can only be defined when `stream=True`.",
        "stream_options",
    )


# --- /invocations dispatch --------------------------------------------------------------------------------


def test_invocations_messages_is_a_chat_completion(client):
    payload = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    via_invocations = client.post("/invocations", json=payload).json()
    direct = client.post("/v1/chat/completions", json=payload).json()
    assert via_invocations["object"] == "chat.completion"
    assert via_invocations["choices"] == direct["choices"]


def test_invocations_prompt_is_a_completion(client):
    payload = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    events = openai_sse(client.post("/invocations", json=payload).text)
    assert events[0]["object"] == "text_completion"


def test_invocations_inputs_stays_lmi_without_tgi_compat(client):
    r = client.post("/invocations", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.text.startswith('{"generated_text": ')  # LMI's spaced JSON, not a TGI list


def test_completion_ignore_eos_forces_exact_token_count(client):
    """vLLM's `ignore_eos`/`min_tokens` extension, which benchmark clients (lmiserve bench) send."""
    body = {"prompt": "Hello", "max_tokens": 24, "min_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [c for c in openai_sse(r.text) if c["choices"]]
    assert len(chunks) == 24 and chunks[-1]["choices"][0]["finish_reason"] == "length"
