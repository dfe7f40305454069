"""The prefix cache over HTTP on the shared tiny-model server (prefix caching on by default, prompts up
to 64 tokens): OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (chat and completions, whole and
streamed), TGI's /info, and the same answers as a server with ``enable_prefix_caching=false``.

Each test sends prompts of its own (a random word in the system message), so what other tests cached
on the shared server never matters."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SYSTEM = "Continuous batching lets new requests join a running batch between decoding steps."


def unique_system() -> str:
    return f"{uuid.uuid4().hex[:6]} {SYSTEM}"


@pytest.fixture(scope="module")
def uncached(server_pool, tiny_model_dir: Path) -> Iterator:
    from conftest import _start  # the integration fixtures' own starter

    yield from _start(tiny_model_dir, "max_input_len=64", "enable_prefix_caching=false", pool=server_pool)


def data_events(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def chat(server, messages: list[dict], **extra) -> dict:
    payload = {"model": server.name, "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    r = server.post(payload, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_usage_reports_the_cached_prompt_tokens(server, uncached):
    system = unique_system()
    first_turn = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    first = chat(server, first_turn)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    answer = first["choices"][0]["message"]["content"]
    second_turn = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    second = chat(server, second_turn)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < second["usage"]["prompt_tokens"] and cached % 16 == 0
    plain = chat(uncached, second_turn)
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert plain["choices"][0]["message"] == second["choices"][0]["message"]
    assert plain["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]


def test_streamed_chat_reports_cached_tokens_in_the_usage_chunk(server):
    messages = [{"role": "system", "content": unique_system()}, {"role": "user", "content": "Hi"}]
    chat(server, messages)
    payload = {
        "model": server.name,
        "messages": messages,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = server.post(payload, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    events = data_events(r.text)
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    assert all(e["usage"] is None for e in events[:-1])


def test_completions_report_cached_tokens_whole_and_streamed(server):
    prompt = unique_system() + " The quick brown fox"
    payload = {"model": server.name, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = server.post(payload, path="/v1/completions").json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = server.post(payload, path="/v1/completions").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    r = server.post({**payload, "stream": True, "stream_options": {"include_usage": True}}, path="/v1/completions")
    last = data_events(r.text)[-1]  # the usage chunk, sent when asked (vLLM's)
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_info_says_whether_prefix_caching_is_on_and_its_size(server, uncached):
    info = server.get("/info").json()
    assert info["prefix_caching"] is True
    assert 0 < info["prefix_cache_size"] <= 512 * 2**20 and info["prefix_cache_tokens"] > 0
    off = uncached.get("/info").json()
    assert (off["prefix_caching"], off["prefix_cache_size"], off["prefix_cache_tokens"]) == (False, 0, 0)
