"""What every route checks before its handler runs, applied once where routes are registered
(`lmiserve.server.errors.protocol_routes`), never in handlers:

- the drain: once the server stops (SIGTERM), every route but `Access.LIVE` (the liveness probe)
  answers `ShuttingDown` (503), the health and readiness probes included (lmiserve.server.drain);
- the API key: with `api_key` set, a route registered as `Access.KEY` (every route that runs a model,
  changes server state or describes the served models) needs ``Authorization: Bearer <key>``; a route
  registered as `Access.OPEN` (health and readiness probes only) does not;
- the body size: `max_request_size` bytes at most, checked from ``Content-Length`` before anything is
  read and counted while a chunked body streams in;
- the head size: `max_header_size` bytes of headers at most (uvicorn also stops buffering a request
  head far above it, answering a bare 400).

They raise neutral errors (`ShuttingDown`, `Unauthorized`, `PayloadTooLarge`, `HeadersTooLarge`) that the route
group's renderer answers in its protocol's shape. Every endpoint wrapped here carries its `Access` as
``endpoint.access``, so the route table can be audited (tests/integration/test_route_access.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from starlette.requests import Request
from starlette.types import Message

from lmiserve.core.errors import HeadersTooLarge, LmiServeError, PayloadTooLarge, ShuttingDown
from lmiserve.server.auth import require_api_key


class Access(Enum):
    OPEN = "open"  # health and readiness probes: never asks for the key
    LIVE = "live"  # the liveness probe: never asks for the key, answers while the server drains
    KEY = "key"  # everything else: needs the key when one is set


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than max_request_size ({limit} bytes)")


def declares_more_than(request: Request, limit: int) -> bool:
    """True when the request's ``Content-Length`` says its body is larger than `limit` bytes."""
    declared = request.headers.get("content-length", "")
    return declared.isdigit() and int(declared) > limit


async def read_body(request: Request, limit: int, error: Callable[[], LmiServeError]) -> bytes:
    """The body of `request`, raising `error()` as soon as it is known to be larger than `limit` bytes:
    from ``Content-Length`` before anything is read, else once the bytes received pass it."""
    if declares_more_than(request, limit):
        raise error()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise error()
        chunks.append(chunk)
    return b"".join(chunks)


def admit(request: Request, access: Access, key_header: str | None = None) -> Request:
    """`request` if it may reach its handler (raises `ShuttingDown`, `HeadersTooLarge`, `Unauthorized`
    or `PayloadTooLarge` otherwise), with its body reader replaced by one that stops at `max_request_size`.
    `key_header`: a header that may carry the API key besides ``Authorization`` (`lmiserve.server.auth`)."""
    if access is not Access.LIVE and request.app.state.drain.active:
        raise ShuttingDown()
    settings = request.app.state.settings
    head = sum(len(name) + len(value) + 4 for name, value in request.scope["headers"])
    if head > settings.max_header_size:
        raise HeadersTooLarge(f"Request headers are larger than max_header_size ({settings.max_header_size} bytes)")
    if access is Access.KEY:
        require_api_key(request, key_header)
    limit = settings.max_request_size
    if declares_more_than(request, limit):
        raise too_large(limit)
    receive = request.receive
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(limit)
        return message

    return Request(request.scope, limited)
