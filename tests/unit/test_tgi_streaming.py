"""The streaming helpers of the TGI/OpenAI routes: keep-alive comments while the source is idle (and the
source closed when the consumer goes away), in-band errors, and non-waiting admission."""

from __future__ import annotations

import asyncio

from lmiserve.core.errors import Overloaded
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.server.streaming import KEEPALIVE, Admission, guarded, keepalive


async def test_keepalive_comments_while_idle_then_the_chunk():
    release = asyncio.Event()

    async def source():
        await release.wait()
        yield b"data: 1\n\n"

    stream = keepalive(source(), 0.01)
    assert await stream.__anext__() == KEEPALIVE
    assert await stream.__anext__() == KEEPALIVE
    release.set()
    rest = [chunk async for chunk in stream]
    assert rest[-1] == b"data: 1\n\n" and set(rest[:-1]) <= {KEEPALIVE}


async def test_closing_the_stream_closes_the_source():
    closed = asyncio.Event()

    async def source():
        try:
            await asyncio.Event().wait()  # never produces
            yield b""
        finally:
            closed.set()

    stream = keepalive(source(), 0.01)
    assert await stream.__anext__() == KEEPALIVE
    await stream.aclose()
    assert closed.is_set()


def _finish(reason: FinishReason, error: str | None = None) -> Finish:
    return Finish(reason=reason, generated_text="", generated_tokens=0, prompt="", prompt_tokens=1, error=error)


async def collect(events, **kw) -> list[bytes]:
    async def gen():
        for e in events:
            if isinstance(e, BaseException):
                raise e
            yield e

    return [c async for c in guarded(gen(), lambda e: b"tok;", lambda exc: f"err:{exc.kind}:{exc.message}".encode(),
                                     lambda: b"end")]


async def test_guarded_error_finish_becomes_a_generation_error():
    chunks = await collect([StepEvent(Token(1, "a", -1.0)), StepEvent(None, finish=_finish(FinishReason.ERROR, "boom"))])
    assert chunks == [b"tok;", b"err:generation:Request failed during generation: boom"]


async def test_guarded_engine_errors_in_tgi_terms():
    assert await collect([Overloaded("full")]) == [b"err:overloaded:Model is overloaded"]
    assert await collect([RuntimeError("bug")]) == [b"err:generation:Request failed during generation: bug"]


async def test_guarded_normal_end():
    assert await collect([StepEvent(Token(1, "a", -1.0), finish=_finish(FinishReason.LENGTH))]) == [b"tok;", b"end"]


def test_admission_never_waits_and_releases_once():
    slots = Admission(2)
    first, second = slots.try_enter(), slots.try_enter()
    assert first and second and slots.try_enter() is None
    first()
    first()  # idempotent
    assert slots.in_flight == 1
    assert slots.try_enter() is not None and slots.try_enter() is None
