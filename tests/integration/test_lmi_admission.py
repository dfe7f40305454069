"""Admission, queue-full and cancellation over real HTTP (reference lmi.md §6.3, §7).

`small_server` has one batch slot and one queue place (``max_rolling_batch_size=1 job_queue_size=1``)
and serves the tiny model with a 4096-token context, so a request asking for LONG tokens holds the
only slot for seconds (about 4-5 s on 2 CPU cores). A request that has to wait for the slot is
therefore slow unless the long request was really aborted when its client went away.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

LONG = 4000  # tokens; ~1000 tokens/s on the tiny model, so seconds of work
PROMPT = "Hello world"
PROMPT_FREE = 2.0  # seconds a short request may take once the slot is free (it takes ~0.1 s)


def long_payload(stream: bool) -> dict:
    return {"inputs": PROMPT, "stream": stream, "parameters": {"max_new_tokens": LONG, "ignore_eos_token": True}}


SHORT = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "ignore_eos_token": True, "details": True}}


class Lines:
    """jsonlines records of a streaming response as they arrive, split on "\\n" only (httpx's
    iter_lines also splits on characters like U+0085 that JSON leaves unescaped). Keep the object
    while the stream should stay open: a discarded byte iterator closes the connection."""

    def __init__(self, response: httpx.Response):
        self._chunks = response.iter_bytes()
        self._buffer = b""

    def __next__(self) -> str:
        while b"\n" not in self._buffer:
            self._buffer += next(self._chunks)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("utf-8")

    def rest(self) -> list[str]:
        self._buffer += b"".join(self._chunks)
        lines = self._buffer.decode("utf-8").split("\n")
        assert lines[-1] == "", "the stream did not end with a complete line"
        return lines[:-1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting until {what}")


def in_queue(server) -> int:
    return server.get(f"/models/{server.name}", timeout=5).json()[0]["models"][0]["requestInQueue"]


def timed_short_request(server, timeout: float = 30.0) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = server.post(SHORT, timeout=timeout)
    return response, time.monotonic() - start


def assert_short_ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert details["generated_tokens"] == 5 and details["finish_reason"] == "length"


@pytest.fixture(autouse=True)
def idle_server(small_server):
    """Every test starts and ends with an idle server (nothing queued, the slot free)."""
    wait_until(lambda: in_queue(small_server) == 0, 10, "the queue is empty")
    response, _ = timed_short_request(small_server)
    assert_short_ok(response)
    yield
    wait_until(lambda: in_queue(small_server) == 0, 10, "the queue is empty")


def test_queue_full_is_503_at_once(small_server):
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as first:
            assert first.status_code == 200
            lines = Lines(first)
            next(lines)  # the long request holds the only slot
            queued = pool.submit(timed_short_request, small_server)  # waits in the only queue place
            wait_until(lambda: in_queue(small_server) == 1, 5, "the second request is queued")

            start = time.monotonic()
            rejected = small_server.post(SHORT, timeout=5)
            elapsed = time.monotonic() - start
            assert rejected.status_code == 503, rejected.text
            assert elapsed < 1.0, f"the 503 took {elapsed:.2f} s"
            assert rejected.headers["content-type"] == "application/json"
            assert rejected.text == (
                "{\n"
                '  "code": 503,\n'
                '  "type": "WlmCapacityException",\n'
                f'  "message": "Worker queue capacity exceeded for model: {small_server.name}"\n'
                "}\n"
            )
            # a streaming request is refused the same way, with a status, before any chunk
            rejected_stream = small_server.post({**SHORT, "stream": True}, timeout=5)
            assert rejected_stream.status_code == 503
            assert rejected_stream.json()["type"] == "WlmCapacityException"
            assert small_server.get("/ping", timeout=5).status_code == 200
            assert not queued.done()  # still waiting for the slot
        # closing the long stream frees the slot: the queued request runs now
        response, _ = queued.result(timeout=PROMPT_FREE + 5)
        assert_short_ok(response)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_queued_request_runs_after_the_running_one(small_server):
    """FIFO admission: the queued request completes (it is not dropped), after the slot frees."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with small_server.new_client() as client, client.stream(
            "POST", "/invocations", json={**long_payload(True), "parameters": {"max_new_tokens": 120, "ignore_eos_token": True}}
        ) as first:
            lines = Lines(first)
            next(lines)
            queued = pool.submit(timed_short_request, small_server)
            rest = lines.rest()
            assert len(rest) == 119
        response, _ = queued.result(timeout=30)
        assert_short_ok(response)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_stream_disconnect_frees_the_slot(small_server):
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "application/jsonlines"
        lines = Lines(stream)
        first, second = next(lines), next(lines)
        assert first.startswith('{"token": ') and second.startswith('{"token": ')
    # the client is gone after 2 of LONG tokens; the next request must not wait for the other LONG-2
    response, elapsed = timed_short_request(small_server)
    assert_short_ok(response)
    assert elapsed < PROMPT_FREE, f"the slot was busy for {elapsed:.2f} s after the client disconnected"


def test_sse_stream_disconnect_frees_the_slot(small_server):
    payload = long_payload(True)
    payload["parameters"]["output_formatter"] = "sse"
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=payload) as stream:
        assert stream.headers["content-type"] == "text/event-stream"
        next(Lines(stream))
    response, elapsed = timed_short_request(small_server)
    assert_short_ok(response)
    assert elapsed < PROMPT_FREE, f"the slot was busy for {elapsed:.2f} s after the client disconnected"


def test_non_streaming_client_timeout_frees_the_slot(small_server):
    with small_server.new_client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/invocations", json=long_payload(False), timeout=0.5)
    response, elapsed = timed_short_request(small_server)
    assert_short_ok(response)
    assert elapsed < PROMPT_FREE, f"the slot was busy for {elapsed:.2f} s after the client timed out"


def test_queued_request_whose_client_leaves_leaves_the_queue(small_server):
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as first:
        lines = Lines(first)
        next(lines)
        with small_server.new_client() as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post("/invocations", json=SHORT, timeout=0.5)  # queued behind the long request
        # gone from the queue at once (well before predict_timeout would expire it, 1 s later)
        wait_until(lambda: in_queue(small_server) == 0, 0.6, "the abandoned request leaves the queue")
        next(lines)  # the long request is unaffected
    response, elapsed = timed_short_request(small_server)
    assert_short_ok(response)
    assert elapsed < PROMPT_FREE


@pytest.mark.parametrize("stream", [False, True])
def test_waiting_longer_than_predict_timeout(small_server, stream):
    """§7: a request that cannot get a slot within predict_timeout (1.5 s here) fails with LMI's
    400 TranslateException, as a status code even when it asked to stream."""
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as first:
        lines = Lines(first)
        next(lines)
        start = time.monotonic()
        response = small_server.post({**SHORT, "stream": stream}, timeout=10)
        elapsed = time.monotonic() - start
        assert response.status_code == 400, (elapsed, response.text)
        assert response.headers["content-type"] == "application/json"
        assert response.text == '{\n  "code": 400,\n  "type": "TranslateException",\n  "message": "Time out in: 1.5"\n}\n'
        assert 1.4 <= elapsed < 3.0, elapsed
        assert in_queue(small_server) == 0
        next(lines)  # the running request is unaffected


def test_server_healthy_after_disconnects(small_server):
    assert small_server.get("/ping").status_code == 200
    model = small_server.get(f"/models/{small_server.name}").json()[0]["models"][0]
    assert model["requestInQueue"] == 0
    assert model["batchSize"] == 1 and model["queueSize"] == 1
