"""The streaming helpers of the TGI/OpenAI routes: keep-alive comments while the source is idle (and the
source closed when the consumer goes away), in-band errors of a TGI stream, and non-waiting admission."""

from __future__ import annotations

import asyncio

from lmiserve.core.errors import Overloaded
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.textgen.admission import Admission
from lmiserve.protocols.tgi.errors import RENDERER
from lmiserve.server.pipeline import DisconnectAwareStream, respond
from lmiserve.server.sse import KEEPALIVE, keepalive


async def serve(response, *, disconnect: asyncio.Event | None = None) -> list[bytes]:
    """Run an ASGI response; the body chunks it sent (the client goes away when `disconnect` is set)."""
    sent: list[bytes] = []
    gone = disconnect or asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            sent.append(message["body"])

    await response({"type": "http"}, receive, send)
    return sent


async def test_keepalive_comments_while_idle_then_the_chunk():
    release = asyncio.Event()

    async def source():
        await release.wait()
        yield b"data: 1\n\n"

    response = DisconnectAwareStream(source(), headers={}, heartbeat=keepalive(0.01))
    serving = asyncio.ensure_future(serve(response))
    await asyncio.sleep(0.05)
    release.set()
    sent = await serving
    assert sent[-1] == b"data: 1\n\n" and len(sent) >= 3 and set(sent[:-1]) == {KEEPALIVE}


async def test_no_keepalive_while_the_stream_produces():
    async def source():
        for i in range(8):
            await asyncio.sleep(0.02)
            yield b"data: %d\n\n" % i

    sent = await serve(DisconnectAwareStream(source(), headers={}, heartbeat=keepalive(0.1)))
    assert KEEPALIVE not in sent and len(sent) == 8


async def test_closing_the_stream_closes_the_source():
    closed = asyncio.Event()
    gone = asyncio.Event()

    async def source():
        try:
            await asyncio.Event().wait()  # never produces
            yield b""
        finally:
            closed.set()

    serving = asyncio.ensure_future(
        serve(DisconnectAwareStream(source(), headers={}, heartbeat=keepalive(0.01)), disconnect=gone)
    )
    await asyncio.sleep(0.03)
    gone.set()  # the client goes away
    assert KEEPALIVE in await serving
    assert closed.is_set()


def _finish(reason: FinishReason, error: str | None = None) -> Finish:
    return Finish(reason=reason, generated_text="", generated_tokens=0, prompt="", prompt_tokens=1, error=error)


class Encoder:
    content_type = "text/event-stream"
    streaming = True

    def on_event(self, index, event) -> bytes:
        return b"tok;"

    def close(self) -> bytes:
        return b"end"

    def error(self, exc) -> bytes:
        return RENDERER.in_band(exc)


def tgi_error(message: str, kind: str) -> bytes:
    return b'data: {"error":"' + message.encode() + b'","error_type":"' + kind.encode() + b'"}\n\n'


async def collect(events) -> list[bytes]:
    async def gen():
        for e in events:
            if isinstance(e, BaseException):
                raise e
            yield 0, e

    response = await respond(None, gen(), Encoder(), in_band=True)  # type: ignore[arg-type] - unused in-band
    return [c async for c in response.body_iterator]


async def test_in_band_error_finish_becomes_a_generation_error():
    chunks = await collect(
        [StepEvent(Token(1, "a", -1.0)), StepEvent(None, finish=_finish(FinishReason.ERROR, "boom"))]
    )
    assert chunks == [b"tok;", tgi_error("Request failed during generation: boom", "generation")]


async def test_in_band_engine_errors_in_tgi_terms():
    assert await collect([Overloaded("full")]) == [tgi_error("Model is overloaded", "overloaded")]
    assert await collect([RuntimeError("bug")]) == [tgi_error("Request failed during generation: bug", "generation")]


async def test_in_band_normal_end():
    assert await collect([StepEvent(Token(1, "a", -1.0), finish=_finish(FinishReason.LENGTH))]) == [b"tok;", b"end"]


def test_admission_never_waits_and_releases_once():
    slots = Admission(2)
    first, second = slots.try_enter(), slots.try_enter()
    assert first and second and slots.try_enter() is None
    first()
    first()  # idempotent
    assert slots.in_flight == 1
    assert slots.try_enter() is not None and slots.try_enter() is None
