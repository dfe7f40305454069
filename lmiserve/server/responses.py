"""Turning event streams into HTTP responses: the first chunk decides status and headers.

Non-streaming formats collect the whole stream (one generation path); streaming formats wait for
the first bytes, so an error before them is still a proper status code, then stream. A client that
disconnects, before or during the stream, cancels iteration, which aborts its sequences.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.lmi.formatters import error_message, frontend_error_body, is_error_finish, lmi_error_body

JSON = "application/json"


class ClientDisconnected(Exception):
    pass


def raw_response(body: bytes, status: int = 200, content_type: str = JSON, headers: dict | None = None) -> Response:
    """Exact bytes with exactly this Content-Type (starlette would append a charset to text/* types)."""
    return Response(body, status_code=status, headers={"content-type": content_type, **(headers or {})})


def error_response(exc: LmiServeError, model_name: str = "") -> Response:
    """LMI's error shapes: compact 424 body for request/generation errors, the front-end shape otherwise."""
    if exc.status == 424:
        return raw_response(lmi_error_body(exc.message), 424)
    message = exc.message
    if exc.kind == "WlmCapacityException" and model_name:
        message = f"{message} for model: {model_name}"
    return raw_response(frontend_error_body(exc.status, exc.kind, message), exc.status)


class DisconnectAwareStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away, whatever the ASGI version,
    so an abandoned stream is cancelled at once rather than at its next write."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond_events(
    request: Request,
    events: AsyncIterator,
    fmt,
    *,
    on_event: Callable[[Any], bytes] | None = None,
    headers: dict | None = None,
) -> Response:
    """Drive one formatter over an event stream and answer with the right status and framing.

    `fmt` has `on_event`, `close`, `error_tail`, `content_type` and `streaming`; `on_event` replaces
    its `on_event` when events come tagged (dynamic batching).
    """
    on_event = on_event or fmt.on_event
    close, error_tail, content_type, streaming = fmt.close, fmt.error_tail, fmt.content_type, fmt.streaming

    async def first_bytes() -> tuple[bytes, bool]:
        """The first non-empty output (or the whole body when not streaming); True if the stream ended."""
        async for event in events:
            if is_error_finish(_event_of(event)):
                raise _GenerationFailed(error_message(_event_of(event)))
            chunk = on_event(event)
            if chunk and streaming:
                return chunk, False
        return close(), True

    try:
        head, ended = await until_disconnect(request, first_bytes())
    except _GenerationFailed as exc:
        await events.aclose()
        return raw_response(lmi_error_body(str(exc)), 424)
    except ClientDisconnected:
        await events.aclose()
        return Response(status_code=499)
    if ended:
        return raw_response(head, 200, content_type, headers)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield head
            async for event in events:
                if is_error_finish(_event_of(event)):
                    yield error_tail(error_message(_event_of(event)))
                    return
                chunk = on_event(event)
                if chunk:
                    yield chunk
            tail = close()
            if tail:
                yield tail
        except LmiServeError as exc:
            yield error_tail(exc.message)
        finally:
            await events.aclose()

    return DisconnectAwareStream(body(), headers={"content-type": content_type, **(headers or {})})


class _GenerationFailed(Exception):
    pass


def _event_of(item):
    """Events may come tagged with their input index (dynamic batching) as (index, event)."""
    return item[1] if isinstance(item, tuple) else item
