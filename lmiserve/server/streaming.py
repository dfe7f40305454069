"""Shared by the TGI and OpenAI routes: request admission (`max_concurrent_requests`), collecting an
event stream for a whole answer, and SSE responses with keep-alive comments.

Admission (reference tgi-openai.md §9.2): a request holds a slot from validation until its response
ends; with every slot taken it is refused at once (429 ``overloaded``), never queued.

Keep-alive (§5): a ``:\\n\\n`` comment after `interval` seconds without an event (the timer restarts
after each event). A client that goes away cancels the stream, which aborts its engine sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from lmiserve.protocols.tgi.parse import from_core, generation_failed
from lmiserve.core.errors import LmiServeError
from lmiserve.core.events import StepEvent
from lmiserve.server.pipeline import DisconnectAwareStream, failure_of, is_error_finish, until_disconnect

log = logging.getLogger(__name__)

KEEPALIVE = b":\n\n"
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}


class Admission:
    """At most `limit` requests in flight; `try_enter` never waits."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def try_enter(self) -> Callable[[], None] | None:
        """A release function (idempotent) when a slot was free, else None."""
        if self.in_flight >= self.limit:
            return None
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release


async def collect(request, events: AsyncIterator) -> list:
    """The whole stream (one generation path); an error finish raises TGI's 424 ``generation`` error,
    engine errors their TGI equivalents; a client disconnect raises `ClientDisconnected`."""

    async def run() -> list:
        out = []
        async for item in events:
            event: StepEvent = item[1] if isinstance(item, tuple) else item
            if is_error_finish(event):
                raise generation_failed(failure_of(event).message)
            out.append(item)
        return out

    try:
        return await until_disconnect(request, run())
    except LmiServeError as exc:
        raise from_core(exc) from None
    finally:
        await events.aclose()


async def keepalive(chunks: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """`chunks`, with a keep-alive comment whenever none came for `interval` seconds."""
    source = chunks.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                chunk = task.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()  # the source's own finally aborts its engine sequences
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(BaseException):
            await source.aclose()


class SseResponse(DisconnectAwareStream):
    """An SSE stream that runs `on_close` when the response is over, however it ended."""

    def __init__(self, chunks: AsyncIterator[bytes], *, interval: float, headers: dict, on_close: Callable[[], None]):
        super().__init__(keepalive(chunks, interval), headers={**SSE_HEADERS, **headers}, on_close=on_close)


async def guarded(
    events: AsyncIterator,
    on_event: Callable[[object], bytes],
    on_error: Callable[[LmiServeError], bytes],
    close: Callable[[], bytes],
) -> AsyncIterator[bytes]:
    """Format a live event stream; any failure becomes the protocol's in-band error as the last chunk."""
    try:
        async for item in events:
            event: StepEvent = item[1] if isinstance(item, tuple) else item
            if is_error_finish(event):
                yield on_error(generation_failed(failure_of(event).message))
                return
            chunk = on_event(item)
            if chunk:
                yield chunk
        yield close()
    except LmiServeError as exc:
        yield on_error(from_core(exc))
    except Exception as exc:  # noqa: BLE001 - the unforeseen still ends the stream with an error event
        log.exception("stream failed")
        yield on_error(generation_failed(str(exc) or type(exc).__name__))
    finally:
        await events.aclose()
