"""Server-wide behaviour of the TGI/OpenAI routes over real HTTP: the API key (401 with an empty body,
OpenAI's error object on its routes; only the health probes open; LMI generation routes covered too),
429 `overloaded` (OpenAI: `rate_limit_error`, the `openai` SDK's RateLimitError) at
`max_concurrent_requests`, SSE keep-alive comments while a stream waits, and slots freed when clients
go away.

The server runs the 2**20-context copy of the tiny model with one batch slot, two admission slots and a
0.2 s keep-alive: a long LMI stream (``ignore_eos_token``, not counted by TGI admission; many minutes of
tokens, so it runs until its client leaves) holds the only engine slot, two TGI/OpenAI streams wait in the engine's queue (idle, so they get keep-alives) and take
both admission slots, and a further request is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from text_generation.errors import OverloadedError

from helpers.server import run_server
from helpers.tiny_model import ENDLESS_CONTEXT

KEY = "s3cret-Key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {
    "inputs": "Deep learning is",
    "stream": True,
    "parameters": {"max_new_tokens": ENDLESS_CONTEXT - 64, "ignore_eos_token": True},
}


@pytest.fixture(scope="module")
def url(endless_model_dir) -> Iterator[str]:
    args = ["--model-id", str(endless_model_dir), "--api-key", KEY]
    for option in (
        "max_concurrent_requests=2",
        "max_rolling_batch_size=1",
        "sse_keepalive_interval=0.2",
        "payload_limit=1000",
        f"max_new_tokens_limit={ENDLESS_CONTEXT}",
    ):
        args += ["-o", option]
    with run_server(args) as base:
        yield base


@pytest.fixture
def client(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
        yield c


def short(client: httpx.Client, path: str = "/generate", headers=None) -> httpx.Response:
    return client.post(path, json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, headers=headers)


# --- API key -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/generate", "/generate_stream", "/", "/tokenize", "/v1/chat/completions", "/v1/completions", "/invocations"],
)
def test_generation_routes_need_the_key(client, path):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.post(path, json={"inputs": "x", "messages": [], "prompt": "x"}, headers=headers)
        if path.startswith("/v1/"):  # OpenAI's routes: its error object
            error = {"message": "missing or wrong API key", "type": "authentication_error", "param": None}
            assert (r.status_code, r.json()) == (401, {"error": {**error, "code": "invalid_api_key"}}), (path, headers)
        else:
            assert (r.status_code, r.content) == (401, b""), (path, headers)


def test_the_key_is_compared_case_insensitively(client):
    assert short(client, headers={"Authorization": f"bearer {KEY.upper()}"}).status_code == 200


def test_lmi_routes_need_the_key(client):
    name = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    assert short(client, f"/predictions/{name}").status_code == 401
    assert short(client, f"/predictions/{name}", headers=AUTH).status_code == 200
    assert short(client, "/invocations", headers=AUTH).status_code == 200


def test_clients_send_the_key(url):
    assert Client(url, headers=AUTH, timeout=30).generate("Hello", max_new_tokens=2).details.generated_tokens == 2
    hub = InferenceClient(base_url=url, api_key=KEY)
    assert isinstance(hub.text_generation("Hello", max_new_tokens=2), str)
    assert hub.chat_completion([{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2


def test_only_probes_are_open(client):
    for path in ("/health", "/", "/ping"):
        assert client.get(path).status_code == 200, path
    for path in ("/info", "/v1/models", "/models"):  # metadata needs the key (SECURITY.md)
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/chat_tokenize", json=chat).status_code == 401
    assert client.post("/chat_tokenize", json=chat, headers=AUTH).status_code == 200


def wait_until_queue_empty(client: httpx.Client, timeout: float = 20.0) -> None:
    """Poll LMI's describe-model `requestInQueue` (the engine's waiting sequences) until it is 0."""
    name = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get(f"/models/{name}", headers=AUTH).json()[0]["models"][0]["requestInQueue"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("aborted sequences are still queued in the engine")


def test_payload_limit(client):
    big = {"inputs": "x" * 2000, "parameters": {"max_new_tokens": 2}}
    message = "Failed to buffer the request body: length limit exceeded"
    r = client.post("/generate", json=big, headers=AUTH)
    assert (r.status_code, r.text) == (413, message)
    r = client.post("/v1/completions", json=big, headers=AUTH)  # OpenAI's error object, JSON
    assert (r.status_code, r.headers["content-type"], r.json()["error"]["message"]) == (
        413,
        "application/json",
        message,
    )
    assert client.post("/invocations", json=big, headers=AUTH).status_code == 200  # LMI has no body limit


def test_payload_limit_on_a_chunked_body(client):
    """No Content-Length: the limit is enforced while the body arrives, not after reading all of it."""

    def body():
        for _ in range(64):  # 64 KiB in 1 KiB pieces, far above payload_limit=1000
            yield b"x" * 1024

    headers = {**AUTH, "Content-Type": "application/json"}
    message = "Failed to buffer the request body: length limit exceeded"
    r = client.post("/generate", content=body(), headers=headers)
    assert (r.status_code, r.text) == (413, message)
    r = client.post("/v1/chat/completions", content=body(), headers=headers)  # OpenAI's error object
    assert (r.status_code, r.json()["error"]["message"]) == (413, message)


# --- overload, keep-alive, disconnect ---------------------------------------------------------------------


_open: list = []  # byte iterators of streams that must stay open (a dropped iterator closes its stream)


def first_bytes(stream: httpx.Response) -> bytes:
    chunks = stream.iter_raw()
    _open.append(chunks)
    for chunk in chunks:
        if chunk:
            return chunk
    raise AssertionError("stream ended without bytes")


def test_overload_keepalive_and_release(url):
    clients = [httpx.Client(base_url=url, timeout=60, trust_env=False) for _ in range(4)]
    holder, tgi_waiter, chat_waiter, other = clients
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    try:
        with holder.stream("POST", "/invocations", json=LONG, headers=AUTH) as running:
            assert first_bytes(running).startswith(b'{"token": ')  # LMI jsonlines: generating
            with (
                tgi_waiter.stream(
                    "POST", "/generate_stream", headers=AUTH, json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}
                ) as queued_tgi,
                chat_waiter.stream("POST", "/v1/chat/completions", headers=AUTH, json=chat) as queued_chat,
            ):
                # both wait behind the long stream for the one engine slot: keep-alive comments only
                assert first_bytes(queued_tgi).startswith(b":\n\n")
                assert first_bytes(queued_chat).startswith(b":\n\n")
                name = other.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
                assert other.get(f"/models/{name}", headers=AUTH).json()[0]["models"][0]["requestInQueue"] == 2

                r = short(other, headers=AUTH)
                assert r.status_code == 429
                assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
                r = other.post(
                    "/v1/chat/completions",
                    headers=AUTH,
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                with (
                    openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30) as sdk,
                    pytest.raises(openai.RateLimitError),
                ):
                    sdk.completions.create(model=name, prompt="Hi", max_tokens=2)
                r = other.post("/generate_stream", headers=AUTH, json={"inputs": "x"})
                assert r.status_code == 200
                assert r.text == 'data: {"error":"Model is overloaded","error_type":"overloaded"}\n\n'
                with pytest.raises(OverloadedError):
                    Client(url, headers=AUTH, timeout=30).generate("Hello", max_new_tokens=2)
            # the waiting clients went away: their engine sequences leave the queue, their slots are free
            wait_until_queue_empty(other)
            with tgi_waiter.stream(
                "POST", "/generate_stream", headers=AUTH, json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}
            ) as admitted:
                assert first_bytes(admitted).startswith(b":\n\n")  # admitted (not 429), waiting for the engine
        # the long stream's client goes away too: its sequence is aborted and the engine serves again
        r = short(other, headers=AUTH)
        assert r.status_code == 200, r.text
    finally:
        _open.clear()
        for c in clients:
            c.close()
