"""Admission, queue-full and cancellation over real HTTP (reference lmi.md §6.3, §7).

`small_server` has one batch slot and one queue place (``max_rolling_batch_size=1 job_queue_size=1``)
and serves the tiny model with a 2**20-token context, so a request asking for LONG tokens holds the
only slot for many minutes, far longer than any test waits. A request that needs the slot therefore
completes only if the long request was really aborted when its client went away; and whatever a
test checks while the long request streams happens while the slot is taken, however slow the machine.
No test measures time except the one about predict_timeout (`impatient_server`, 1.5 s), and only
from below.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.tiny_model import ENDLESS_CONTEXT
from helpers.waiting import HANG_TIMEOUT, wait_until

LONG = ENDLESS_CONTEXT - 64  # tokens; ~1000 tokens/s on the tiny model, so many minutes of work
PROMPT = "Hello world"
# a client that gives up waiting for the answer (connecting and sending are never what times out)
READ_TIMEOUT = httpx.Timeout(HANG_TIMEOUT, read=0.5)


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


def in_queue(server) -> int:
    return server.get(f"/models/{server.name}").json()[0]["models"][0]["requestInQueue"]


def short_request(server) -> httpx.Response:
    """SHORT; it needs the only slot, so it completes only once nothing else holds it."""
    return server.post(SHORT, timeout=HANG_TIMEOUT)


def assert_short_ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert details["generated_tokens"] == 5 and details["finish_reason"] == "length"


@pytest.fixture(autouse=True)
def idle_server(request):
    """Every test starts and ends with an idle server (nothing queued, the slot free)."""
    servers = [
        request.getfixturevalue(name) for name in ("small_server", "impatient_server") if name in request.fixturenames
    ]
    for server in servers:
        wait_until(lambda server=server: in_queue(server) == 0, "the queue is empty")
        assert_short_ok(short_request(server))
    yield
    for server in servers:
        wait_until(lambda server=server: in_queue(server) == 0, "the queue is empty")


def test_queue_full_is_503_at_once(small_server):
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with (
            small_server.new_client() as client,
            client.stream("POST", "/invocations", json=long_payload(True)) as first,
        ):
            assert first.status_code == 200
            lines = Lines(first)
            next(lines)  # the long request holds the only slot
            queued = pool.submit(short_request, small_server)  # waits in the only queue place
            wait_until(lambda: in_queue(small_server) == 1, "the second request is queued")

            rejected = small_server.post(SHORT)
            assert rejected.status_code == 503, rejected.text
            # at once: answered while the slot and the queue place are still taken (a request that
            # waited for room would wait for the long request, i.e. until its client leaves)
            assert in_queue(small_server) == 1 and not queued.done()
            assert rejected.headers["content-type"] == "application/json"
            assert rejected.text == (
                "{\n"
                '  "code": 503,\n'
                '  "type": "WlmCapacityException",\n'
                f'  "message": "Worker queue capacity exceeded for model: {small_server.name}"\n'
                "}\n"
            )
            # a streaming request is refused the same way, with a status, before any chunk
            rejected_stream = small_server.post({**SHORT, "stream": True})
            assert rejected_stream.status_code == 503
            assert rejected_stream.json()["type"] == "WlmCapacityException"
            assert small_server.get("/ping").status_code == 200
            next(lines)  # the long request still holds the slot
            assert not queued.done()  # still waiting for the slot
        # closing the long stream frees the slot: the queued request runs now
        assert_short_ok(queued.result(timeout=HANG_TIMEOUT))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_queued_request_runs_after_the_running_one(small_server):
    """FIFO admission: the queued request completes (it is not dropped), after the slot frees."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        with (
            small_server.new_client() as client,
            client.stream(
                "POST",
                "/invocations",
                json={**long_payload(True), "parameters": {"max_new_tokens": 120, "ignore_eos_token": True}},
            ) as first,
        ):
            lines = Lines(first)
            next(lines)
            queued = pool.submit(short_request, small_server)
            rest = lines.rest()
            assert len(rest) == 119
        assert_short_ok(queued.result(timeout=HANG_TIMEOUT))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_stream_disconnect_frees_the_slot(small_server):
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"] == "application/jsonlines"
        lines = Lines(stream)
        first, second = next(lines), next(lines)
        assert first.startswith('{"token": ') and second.startswith('{"token": ')
    # the client is gone after 2 of LONG tokens; the next request gets the slot only if the other
    # LONG-2 tokens (many minutes of work) were abandoned
    assert_short_ok(short_request(small_server))


def test_sse_stream_disconnect_frees_the_slot(small_server):
    payload = long_payload(True)
    payload["parameters"]["output_formatter"] = "sse"
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=payload) as stream:
        assert stream.headers["content-type"] == "text/event-stream"
        next(Lines(stream))
    assert_short_ok(short_request(small_server))  # the slot is free again: the long request was aborted


def test_non_streaming_client_timeout_frees_the_slot(small_server):
    with small_server.new_client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/invocations", json=long_payload(False), timeout=READ_TIMEOUT)
    assert_short_ok(short_request(small_server))  # the slot is free again: the long request was aborted


def test_queued_request_whose_client_leaves_leaves_the_queue(small_server):
    with small_server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as first:
        lines = Lines(first)
        next(lines)
        with small_server.new_client() as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post("/invocations", json=SHORT, timeout=READ_TIMEOUT)  # queued behind the long request
        # it leaves the queue because its client left (predict_timeout, 120 s, would expire it much later)
        wait_until(lambda: in_queue(small_server) == 0, "the abandoned request leaves the queue")
        next(lines)  # the long request is unaffected
    assert_short_ok(short_request(small_server))


@pytest.mark.parametrize("stream", [False, True])
def test_waiting_longer_than_predict_timeout(impatient_server, stream):
    """§7: a request that cannot get a slot within predict_timeout (1.5 s here) fails with LMI's
    400 TranslateException, as a status code even when it asked to stream."""
    server = impatient_server
    with server.new_client() as client, client.stream("POST", "/invocations", json=long_payload(True)) as first:
        lines = Lines(first)
        next(lines)
        start = time.monotonic()
        response = server.post({**SHORT, "stream": stream}, timeout=HANG_TIMEOUT)
        elapsed = time.monotonic() - start
        assert response.status_code == 400, (elapsed, response.text)
        assert response.headers["content-type"] == "application/json"
        assert (
            response.text == '{\n  "code": 400,\n  "type": "TranslateException",\n  "message": "Time out in: 1.5"\n}\n'
        )
        assert elapsed >= 1.4, elapsed  # it waited for the slot (at least predict_timeout)...
        assert in_queue(server) == 0
        next(lines)  # ...and failed while the running request, unaffected, still held the slot


def test_server_healthy_after_disconnects(small_server):
    assert small_server.get("/ping").status_code == 200
    model = small_server.get(f"/models/{small_server.name}").json()[0]["models"][0]
    assert model["requestInQueue"] == 0
    assert model["batchSize"] == 1 and model["queueSize"] == 1
