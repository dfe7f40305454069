"""/invocations with ``tgi_compat=true``: an `inputs` body answers exactly
like TGI's POST / (list, or the native SSE with ``stream: true``; TGI errors), while an LMI
``output_formatter`` and the /predictions routes keep LMI semantics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

PROMPT = "Deep learning is"
TIMING = {
    "x-compute-time",
    "x-total-time",
    "x-validation-time",
    "x-queue-time",
    "x-inference-time",
    "x-time-per-token",
    "date",
    "x-request-id",  # new for every request (lmiserve.server.access)
}


@pytest.fixture(scope="module")
def client(server_pool, tiny_model_dir) -> Iterator[httpx.Client]:
    url = server_pool.url(["--model-id", str(tiny_model_dir), "-o", "tgi_compat=true"])  # shared
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        yield c


def same_answer(a: httpx.Response, b: httpx.Response) -> None:
    assert (a.status_code, a.content) == (b.status_code, b.content)
    assert {k: v for k, v in a.headers.items() if k not in TIMING} == {
        k: v for k, v in b.headers.items() if k not in TIMING
    }


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
def test_invocations_is_tgi_compat_route(client, payload):
    same_answer(client.post("/invocations", json=payload), client.post("/", json=payload))


def test_list_shape(client):
    body = client.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).json()
    assert isinstance(body, list) and list(body[0]) == ["generated_text"]


def test_lmi_output_formatter_keeps_lmi(client):
    r = client.post(
        "/invocations",
        json={"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3, "output_formatter": "jsonlines"}},
    )
    assert r.headers["content-type"] == "application/jsonlines"
    assert all("token" in json.loads(line) for line in r.text.splitlines())


def test_messages_body_is_still_a_chat_completion(client):
    r = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.json()["object"] == "chat.completion"
