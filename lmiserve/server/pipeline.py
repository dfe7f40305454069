"""The one response pipeline: engine events -> an encoder -> an HTTP response, streamed or whole.

Every generation route hands `respond` a stream of `Tagged` events (input index, event; a request
of one input is tagged 0 by `tagged`) and an `Encoder` of its protocol:

- not streaming: the stream is collected (non-streaming = streaming collected) and answered with
  `encoder.close()`; an error finish raises `GenerationFailed`, which the route group's renderer
  answers like any other error;
- streaming, `in_band=False` (LMI): the response waits for the first bytes, so a failure before
  them still gets a proper status; after them a failure is `encoder.error(exc)`, the last chunk;
- streaming, `in_band=False, wait_for="event"` (Triton generate): the status waits only for the
  first event, so a failure before it (a refused submit, a queue timeout) still gets a proper status;
  from the first event on, an error finish included, every failure is in-band;
- streaming, `in_band=True` (TGI, OpenAI): the response starts at once (200) and every failure is
  in-band.

A stream may carry a `Heartbeat`: a chunk (e.g. an SSE comment) sent whenever it was silent for its
interval (a stream that keeps producing never carries one).

A client that disconnects, before or during the stream, cancels iteration, which aborts its
sequences (an abandoned whole answer gets 499, which nobody reads).

The first token and every finish are noted in the request's access facts
(lmiserve.core.request_context; lmiserve.server.access writes the line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from lmiserve.core import request_context
from lmiserve.core.aio import merge_tagged
from lmiserve.core.errors import GenerationFailed, LmiServeError
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request_context import RequestFacts
from lmiserve.server.responses import raw_response

log = logging.getLogger(__name__)

__all__ = [
    "ClientDisconnected",
    "DisconnectAwareStream",
    "Encoder",
    "Heartbeat",
    "Tagged",
    "failure_of",
    "is_error_finish",
    "merge_tagged",
    "respond",
    "tagged",
    "until_disconnect",
]

Tagged = tuple[int, StepEvent]
Headers = Mapping[str, str] | Callable[[], Mapping[str, str]] | None
T = TypeVar("T")

# LMI's generic message for a sequence that failed without saying why.
DEFAULT_ERROR_MESSAGE = "exception occurred during rolling batch inference"


class Encoder(Protocol):
    """Turns one request's tagged events into response bytes, incrementally."""

    content_type: str  # exactly as sent
    streaming: bool  # True: each chunk is sent as it comes; False: close() returns the whole body

    def on_event(self, index: int, event: StepEvent) -> bytes:
        """Bytes to send for this event now (b"" when nothing, always b"" when not streaming)."""
        ...

    def close(self) -> bytes:
        """Called once after the last event: the remaining bytes (the whole body if not streaming).
        May raise an `LmiServeError` (e.g. `IncompleteGeneration`) before anything was sent."""
        ...

    def error(self, exc: LmiServeError) -> bytes:
        """The in-band error that ends a stream after its first bytes were sent."""
        ...


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


def is_error_finish(event: StepEvent) -> bool:
    """True for the event that ends a sequence because of a failure (reason ERROR)."""
    return event.finish is not None and event.finish.reason is FinishReason.ERROR


def failure_of(event: StepEvent) -> GenerationFailed:
    """The error an error finish stands for (the engine's message, or LMI's generic one)."""
    finish = event.finish
    return GenerationFailed((finish.error if finish is not None else None) or DEFAULT_ERROR_MESSAGE)


async def tagged(events: AsyncIterator[StepEvent], index: int = 0) -> AsyncIterator[Tagged]:
    """One request's events tagged with its input index (closing this closes `events`)."""
    try:
        async for event in events:
            yield index, event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass(frozen=True)
class Heartbeat:
    """`chunk` sent whenever a stream was silent for `interval` seconds (the timer restarts after every
    chunk sent)."""

    interval: float
    chunk: bytes


class DisconnectAwareStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away, whatever the ASGI version,
    so an abandoned stream is cancelled at once rather than at its next write; `on_close` runs when
    the response is over, however it ended; with a `heartbeat`, its chunk fills every silence."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: Mapping[str, str],
        on_close: Callable[[], None] | None = None,
        heartbeat: Heartbeat | None = None,
    ):
        super().__init__(content, headers=dict(headers))
        self._on_close = on_close
        self._heartbeat = heartbeat
        self._send_lock = asyncio.Lock()  # the body and the heartbeat never send at the same time
        self._last_send = 0.0
        self._streaming = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                if self._heartbeat is not None:
                    group.start_soon(self._beat, send, self._heartbeat)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if self._on_close is not None:
                self._on_close()

    async def stream_response(self, send: Send) -> None:
        if self._heartbeat is None:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._last_send, self._streaming = time.monotonic(), True
        async for chunk in self.body_iterator:
            async with self._send_lock:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._last_send = time.monotonic()
        async with self._send_lock:
            self._streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _beat(self, send: Send, heartbeat: Heartbeat) -> None:
        """One timer task per stream (not one per chunk): sleeps until `interval` after the last send."""
        while True:
            due = (self._last_send if self._streaming else time.monotonic()) + heartbeat.interval
            if (wait := due - time.monotonic()) > 0:
                await anyio.sleep(wait)
                continue
            async with self._send_lock:
                if not self._streaming:
                    return  # the body is complete
                await send({"type": "http.response.body", "body": heartbeat.chunk, "more_body": True})
                self._last_send = time.monotonic()


def _headers(headers: Headers) -> dict[str, str]:
    if headers is None:
        return {}
    return dict(headers() if callable(headers) else headers)


async def respond(
    request: Request,
    events: AsyncIterator[Tagged],
    encoder: Encoder,
    *,
    headers: Headers = None,
    in_band: bool = False,
    wait_for: Literal["bytes", "event"] = "bytes",
    on_close: Callable[[], None] | None = None,
    heartbeat: Heartbeat | None = None,
) -> Response:
    """Drive `encoder` over `events` and answer (see the module docstring).

    `headers` (or a function giving them, called once the whole answer or the stream's head is
    ready); `wait_for` (streaming, not `in_band`): what decides the status, the first bytes or the
    first event; `on_close` runs when the response is over, however
    it ended (e.g. to release an admission slot); `heartbeat` fills a streamed answer's silences (e.g.
    SSE keep-alive comments).
    """
    closing = _Once(on_close)
    facts = request_context.current()
    if facts is not None:
        events = _observed(events, facts)
    try:
        if not encoder.streaming:
            return await _whole(request, events, encoder, headers)
        if in_band:
            chunks = _in_band_chunks(events, encoder)
            return DisconnectAwareStream(
                chunks,
                headers={"content-type": encoder.content_type, **_headers(headers)},
                on_close=closing,
                heartbeat=heartbeat,
            )
        return await _streamed(request, events, encoder, headers, closing, wait_for, heartbeat)
    except BaseException:
        closing()
        raise
    finally:
        if not encoder.streaming:
            closing()


async def _observed(events: AsyncIterator[Tagged], facts: RequestFacts) -> AsyncIterator[Tagged]:
    """`events` unchanged, noted in the request's access facts (first token, finishes; no logging)."""
    try:
        async for index, event in events:
            facts.observe(index, event)
            yield index, event
    finally:
        await _aclose(events)


async def _whole(request: Request, events: AsyncIterator[Tagged], encoder: Encoder, headers: Headers) -> Response:
    async def run() -> bytes:
        async for index, event in events:
            if is_error_finish(event):
                raise failure_of(event)
            encoder.on_event(index, event)
        return encoder.close()

    try:
        body = await until_disconnect(request, run())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await _aclose(events)
    return raw_response(body, 200, encoder.content_type, _headers(headers))


async def _streamed(
    request: Request,
    events: AsyncIterator[Tagged],
    encoder: Encoder,
    headers: Headers,
    closing: Callable[[], None],
    wait_for: str = "bytes",
    heartbeat: Heartbeat | None = None,
) -> Response:
    async def first_bytes() -> tuple[bytes, bool, bool]:
        """The first non-empty chunk (with `wait_for="event"`: the first event's, maybe empty); True if
        the stream ended before it; True if that chunk is an in-band error that ends the stream."""
        async for index, event in events:
            if is_error_finish(event):
                if wait_for == "event":
                    return encoder.error(failure_of(event)), False, True
                raise failure_of(event)
            chunk = encoder.on_event(index, event)
            if chunk or wait_for == "event":
                return chunk, False, False
        return encoder.close(), True, False

    try:
        head, ended, failed = await until_disconnect(request, first_bytes())
    except ClientDisconnected:
        await _aclose(events)
        closing()
        return Response(status_code=499)
    except BaseException:
        await _aclose(events)
        raise
    if ended:
        closing()
        return raw_response(head, 200, encoder.content_type, _headers(headers))

    if failed:
        await _aclose(events)

    async def body() -> AsyncIterator[bytes]:
        if head:
            yield head
        if not failed:
            async for chunk in _in_band_chunks(events, encoder):
                yield chunk

    chunks = body()
    return DisconnectAwareStream(
        chunks,
        headers={"content-type": encoder.content_type, **_headers(headers)},
        on_close=closing,
        heartbeat=heartbeat,
    )


async def _in_band_chunks(events: AsyncIterator[Tagged], encoder: Encoder) -> AsyncIterator[bytes]:
    """Encode a live event stream; any failure becomes the encoder's in-band error, the last chunk. The
    chunks of a `burst` (events the engine delivered at once) go out as one, with the first event after it."""
    burst: list[bytes] = []

    def after_burst(chunk: bytes) -> bytes:
        """`chunk` with the burst's chunks before it (the burst then empty)."""
        if not burst:
            return chunk
        joined = b"".join([*burst, chunk])
        burst.clear()
        return joined

    try:
        async for index, event in events:
            if is_error_finish(event):
                yield after_burst(encoder.error(failure_of(event)))
                return
            chunk = encoder.on_event(index, event)
            if event.burst:
                burst.append(chunk)
            elif chunk := after_burst(chunk):
                yield chunk
        if tail := after_burst(encoder.close()):
            yield tail
    except LmiServeError as exc:
        yield after_burst(encoder.error(exc))
    except Exception as exc:  # noqa: BLE001 - the unforeseen still ends the stream with an error event
        log.exception("stream failed")
        yield after_burst(encoder.error(GenerationFailed(str(exc) or type(exc).__name__)))
    finally:
        await _aclose(events)


async def _aclose(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()


class _Once:
    """Call `fn` at most once."""

    def __init__(self, fn: Callable[[], None] | None):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
