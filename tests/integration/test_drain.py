"""The graceful drain of `lmiserve serve` (lmiserve/server/drain.py), on real processes with real signals.

After SIGTERM the health and readiness probes answer 503 at once and every new request gets a 503 in
its protocol's shape (only `/v2/health/live` stays 200); the requests in flight run on, streams
included, and the process exits 0 once they end; a stream still open at `drain_timeout` is ended
with its protocol's in-band error, and the process still exits 0; with nothing in flight it exits at
once, without waiting for `drain_timeout`. (A second signal during the drain exits at once:
test_signals.py.)

A request is held in flight deterministically by an endless stream (minutes of tokens: a model with a
2**20-token context whose EOS cannot be generated) that the test ends itself (by disconnecting) or
leaves to the drain's deadline; with `max_rolling_batch_size=1`, the streams sent after it wait in the
queue, so all their tokens are generated after the signal.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers.route_table import VERTEX_ENV, Entry, concrete, entries, expected
from helpers.serve_process import HANG_TIMEOUT, ServeProcess
from helpers.tiny_model import ENDLESS_CONTEXT, with_context
from lmiserve.core.errors import ShuttingDown
from lmiserve.server.guard import Access

pytestmark = pytest.mark.e2e  # the slowest tier: SIGTERM to real processes, drains that wait

SHUTTING_DOWN = "The server is shutting down"
ENDLESS = {"max_new_tokens": ENDLESS_CONTEXT - 64}
NEVER = 3600  # a drain_timeout far beyond the hang guard (HANG_TIMEOUT): the drain ends when its requests do
# TGI's, LMI's and KServe's 503 bodies (lmiserve/protocols/*/errors.py; KServe's readiness routes add
# "ready": false)
TGI_503 = {"error": SHUTTING_DOWN, "error_type": "unhealthy"}
LMI_503 = {"code": 503, "type": "ServiceUnavailableException", "message": SHUTTING_DOWN}
KSERVE_503 = {"error": SHUTTING_DOWN}


@pytest.fixture(scope="module")
def endless_model_dir(unreachable_eos_model_dir, tmp_path_factory) -> Path:
    """The tiny model that never ends a generation early, with an ENDLESS_CONTEXT context."""
    return with_context(unreachable_eos_model_dir, tmp_path_factory.mktemp("drain") / "endless-no-eos", ENDLESS_CONTEXT)


def server_args(endless_model_dir, drain_timeout: float, *options: str) -> list[str]:
    args = ["--model-id", str(endless_model_dir), "-o", f"max_new_tokens_limit={ENDLESS_CONTEXT}"]
    for option in (f"drain_timeout={drain_timeout}", *options):
        args += ["-o", option]
    return args


def client(server: ServeProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=HANG_TIMEOUT, trust_env=False)


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of an SSE stream, as they come."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


def first(count: int, it: Iterator[str]) -> list[str]:
    out = [item for _, item in zip(range(count), it, strict=False)]
    assert len(out) == count, f"the stream ended after {len(out)} events"
    return out


def assert_clean_exit(server: ServeProcess) -> None:
    assert server.wait_exit() == 0, server.describe()
    err = server.stderr()
    assert "Traceback" not in err, server.describe()
    assert not [line for line in err.splitlines() if line.startswith("lmiserve: ")], server.describe()


def model_name(c: httpx.Client) -> str:
    return str(c.get("/v1/models").json()["data"][0]["id"])


# --- every route during the drain -----------------------------------------------------------------------


def _drain_entries() -> list[Entry]:
    return entries({Access.KEY, Access.OPEN, Access.LIVE})


class TestDuringTheDrain:
    @pytest.fixture(scope="class")
    def draining(self, endless_model_dir) -> Iterator[tuple[httpx.Client, str]]:
        """A server draining after SIGTERM, held in the drain by an endless stream until this class's
        tests are done; then the stream is dropped, and the process must exit 0."""
        with ServeProcess(server_args(endless_model_dir, NEVER), env=VERTEX_ENV) as server, client(server) as c:
            server.wait_healthy()
            name = model_name(c)
            with c.stream("POST", "/generate_stream", json={"inputs": "Deep", "parameters": ENDLESS}) as held:
                held_events = sse_events(held)  # kept: a dropped iterator closes the response
                first(2, held_events)
                server.send(signal.SIGTERM)
                server.wait_stderr("draining: waiting up to")
                yield c, name
            assert_clean_exit(server)
            assert "drained: every request in flight has ended" in server.stderr()

    @pytest.mark.parametrize("entry", _drain_entries(), ids=lambda e: f"{e.method} {e.path}")
    def test_every_route_but_liveness_answers_503_in_its_protocols_shape(self, draining, entry):
        c, name = draining
        path = concrete(entry.path, name, entry.method)
        r = c.request(entry.method, path, json={"inputs": "hi"})
        if entry.access is Access.LIVE:
            assert r.status_code == 200, (path, r.text)
        else:
            assert (r.status_code, r.content) == expected(entry, ShuttingDown()), path

    def test_the_probes_turn_503(self, draining):
        c, name = draining
        assert (c.get("/ping").status_code, c.get("/ping").json()) == (503, LMI_503)
        for path in ("/health", "/"):  # TGI
            assert (c.get(path).status_code, c.get(path).json()) == (503, TGI_503)
        for path in ("/v2/health/ready", f"/v2/models/{name}/ready"):
            assert (c.get(path).status_code, c.get(path).json()) == (503, {**KSERVE_503, "ready": False})
        assert c.get("/vertex/health").status_code == 503
        live = c.get("/v2/health/live")  # liveness: the process is alive and working
        assert (live.status_code, live.json()) == (200, {"live": True})


# --- in-flight streams finish -------------------------------------------------------------------------------


def test_streams_in_flight_complete_after_sigterm_while_new_requests_get_503(endless_model_dir):
    args = server_args(endless_model_dir, NEVER, "max_rolling_batch_size=1")
    with ServeProcess(args) as server, client(server) as c, client(server) as c2, client(server) as c3:
        server.wait_healthy()
        name = model_name(c)
        # The endless stream takes the only batch slot; the two streams after it wait for it.
        with (
            c.stream("POST", "/generate_stream", json={"inputs": "Deep learning is", "parameters": ENDLESS}) as held,
            c2.stream(
                "POST", "/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 16}}
            ) as tgi,
            c3.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": True},
            ) as chat,
        ):
            assert (held.status_code, tgi.status_code, chat.status_code) == (200, 200, 200)
            held_events = sse_events(held)  # kept: a dropped iterator closes the response
            first(2, held_events)

            server.send(signal.SIGTERM)
            server.wait_stderr("draining: waiting up to")
            assert "for 3 request(s) in flight" in server.stderr()

            with client(server) as fresh:  # a new connection: the listener still accepts, to answer 503
                r = fresh.get("/ping")
                assert (r.status_code, r.json()) == (503, LMI_503)
                r = fresh.post("/generate", json={"inputs": "hi"})
                assert (r.status_code, r.json()) == (503, TGI_503)
                r = fresh.post("/invocations", json={"inputs": "hi"})
                assert (r.status_code, r.json()) == (503, LMI_503)
                r = fresh.post(f"/v2/models/{name}/infer", json={"inputs": [_text_input("hi")]})
                assert (r.status_code, r.json()) == (503, KSERVE_503)
                assert fresh.get("/v2/health/live").status_code == 200

            held.close()  # the client drops the endless stream: the waiting streams get the slot

            tgi_events = [json.loads(e) for e in sse_events(tgi)]
            assert tgi_events and all("error" not in e for e in tgi_events), tgi_events
            assert tgi_events[-1]["generated_text"] is not None  # TGI's last event: the stream ended normally
            chat_events = list(sse_events(chat))
            assert chat_events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in chat_events[:-1]]
            assert all("error" not in chunk for chunk in chunks), chunks
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert_clean_exit(server)
        assert "drained: every request in flight has ended" in server.stderr()


def _text_input(text: str) -> dict:
    return {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [text]}


# --- the deadline -------------------------------------------------------------------------------------------


def test_streams_still_open_at_drain_timeout_end_with_their_in_band_error_and_the_process_exits_0(
    endless_model_dir,
):
    requests = {
        "tgi": ("/generate_stream", {"inputs": "Deep learning is", "parameters": ENDLESS}),
        "lmi": ("/invocations", {"inputs": "Deep learning is", "stream": True, "parameters": ENDLESS}),
        "openai": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": ENDLESS_CONTEXT - 64, "stream": True},
        ),
    }
    with ServeProcess(server_args(endless_model_dir, 1)) as server, contextlib.ExitStack() as stack:
        server.wait_healthy()
        lines = {}
        for kind, (path, body) in requests.items():
            response = stack.enter_context(stack.enter_context(client(server)).stream("POST", path, json=body))
            assert response.status_code == 200, kind
            lines[kind] = _lines(response)
            first(2, lines[kind])
        server.send(signal.SIGTERM)
        with ThreadPoolExecutor(len(requests)) as pool:  # read every stream to its end, together
            tails = dict(zip(requests, pool.map(lambda kind: list(lines[kind])[-2:], requests), strict=True))
        assert_clean_exit(server)
        assert "drain_timeout (1 s) reached: ending 3 request(s) still open" in server.stderr()

    tgi_error = json.loads(tails["tgi"][-1])  # TGI: one `data: {"error", "error_type"}` event
    assert tgi_error["error_type"] == "generation" and SHUTTING_DOWN in tgi_error["error"]
    assert json.loads(tails["lmi"][-1]) == {"error": SHUTTING_DOWN, "code": 424}  # LMI jsonlines: the error line
    openai_error, done = tails["openai"]  # OpenAI: an error event, then [DONE]
    assert done == "[DONE]" and SHUTTING_DOWN in json.loads(openai_error)["error"]["message"]


def _lines(response: httpx.Response) -> Iterator[str]:
    """A stream's non-empty lines, the SSE `data:` prefix removed."""
    for line in response.iter_lines():
        if line.strip():
            yield line[len("data:") :].strip() if line.startswith("data:") else line


# --- nothing in flight --------------------------------------------------------------------------------------


def test_sigterm_with_nothing_in_flight_exits_without_waiting_for_drain_timeout(endless_model_dir):
    """drain_timeout is an hour, far beyond the hang guard: only a drain that waits for nothing exits.
    An idle keep-alive connection is not a request in flight."""
    with ServeProcess(server_args(endless_model_dir, NEVER)) as server, client(server) as c:
        server.wait_healthy()
        assert c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
        server.send(signal.SIGTERM)  # the client's connection stays open, idle
        assert_clean_exit(server)
        assert "draining: waiting" not in server.stderr()
