"""A server with `--stream-interval 4`: every protocol streams the same events as before (one line, one SSE
event a token), written four tokens at a time after the first; the text is the whole answer's."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from helpers.server import run_server

TOKENS = 13
INTERVAL = 4


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path) -> Iterator[str]:
    with run_server(["--model-id", str(tiny_model_dir), "--stream-interval", str(INTERVAL)]) as base:
        yield base


def raw_reads(url: str, path: str, body: dict) -> list[bytes]:
    """The body of one streamed response as the socket gave it, read by read (a plain HTTP/1.1 request)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        )
        sock.sendall(head.encode() + b"Connection: close\r\n\r\n" + payload)
        reads = []
        while data := sock.recv(1 << 16):
            reads.append(data)
    return reads


def test_lmi_lines_come_four_tokens_a_write(url):
    body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": TOKENS, "ignore_eos_token": True}}
    whole = httpx.post(f"{url}/invocations", json=body, timeout=60).json()["generated_text"]
    reads = raw_reads(url, "/invocations", {**body, "stream": True})
    counts = [read.count(b'"token"') for read in reads]
    assert sum(counts) == TOKENS
    # the first token alone, then groups of four: at most 1 + ceil(12 / 4) reads carry tokens (the socket
    # may merge writes, never split a group into more reads than writes at this size)
    assert 1 <= len([c for c in counts if c]) <= 1 + math.ceil((TOKENS - 1) / INTERVAL), counts
    lines = [
        json.loads(line) for line in b"".join(reads).split(b"\r\n\r\n", 1)[1].splitlines() if line.startswith(b"{")
    ]
    assert "".join(line["token"]["text"] for line in lines) == whole
    assert lines[-1]["generated_text"] == whole


def test_openai_and_tgi_streams_are_unchanged(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    kwargs = {"model": "tiny", "prompt": "Hello world", "max_tokens": TOKENS, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert len([c for c in chunks if c.choices]) == TOKENS  # one chunk a token, as with stream_interval=1

    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": TOKENS, "details": True}}
    events = [
        json.loads(line[5:])
        for line in httpx.post(f"{url}/generate_stream", json=body, timeout=60).text.splitlines()
        if line.startswith("data:")
    ]
    generated = httpx.post(f"{url}/generate", json=body, timeout=60).json()["generated_text"]
    assert events[-1]["generated_text"] == generated and len(events) == events[-1]["details"]["generated_tokens"]
