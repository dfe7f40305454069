"""Rendering neutral errors per protocol, registered once per route group.

A protocol defines one `ErrorRenderer` (in `lmiserve/protocols/<name>/errors.py`): the status and
body of every `lmiserve.core.errors` class in its wire format, and the in-band error a stream sends
once its first byte is out. `protocol_routes(renderer, routes)` wraps the endpoints of a group so an
`LmiServeError` raised anywhere below a route is answered by that renderer: route functions contain
no `except` for lmiserve's own errors. The wrapper also notes the route and its protocol in the
request's facts (lmiserve.core.request_context; the innermost renderer's protocol wins, so a
/invocations request answered by OpenAI's handler is logged and counted as OpenAI's): the access line
and the request metrics read them.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from lmiserve.core import request_context
from lmiserve.core.errors import LmiServeError
from lmiserve.server.apidoc import ATTRIBUTE, Reply
from lmiserve.server.guard import Access, admit
from lmiserve.server.responses import raw_response

V = TypeVar("V")
Endpoint = Callable[[Request], Awaitable[Response]]


def lookup(exc: LmiServeError, table: Mapping[type[LmiServeError], V], default: V) -> V:
    """The entry for the most specific class of `exc` in `table` (walks the MRO), else `default`."""
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return default


class ErrorRenderer(ABC):
    """One protocol's error shapes."""

    content_type: str = "application/json"
    protocol: str = ""  # the protocol's name in the access log: lmi, tgi, openai, kserve, ...
    key_header: str | None = None  # a header its clients send the API key in, besides Authorization (auth.py)

    @abstractmethod
    def status(self, exc: LmiServeError) -> int:
        """The HTTP status of `exc` in this protocol."""

    @abstractmethod
    def body(self, exc: LmiServeError) -> bytes:
        """The response body of `exc` (before any byte of a response was sent)."""

    def headers(self, exc: LmiServeError, request: Request) -> dict[str, str]:
        """Extra response headers for an error answer (none by default)."""
        return {}

    def response(self, exc: LmiServeError, request: Request) -> Response:
        return raw_response(self.body(exc), self.status(exc), self.content_type, self.headers(exc, request))

    def in_band(self, exc: LmiServeError) -> bytes:
        """The error as the last chunk of a stream that already started (default: the body)."""
        return self.body(exc)

    def documented(self) -> dict[int, Reply]:
        """The error answers of this protocol by status, for the API document (`server.openapi`)."""
        return {}


def rendered_by(
    renderer: ErrorRenderer, endpoint: Endpoint, access: Access | None = None, route: str | None = None
) -> Endpoint:
    """`endpoint` with every `LmiServeError` it raises answered by `renderer`; with `access`, the
    request first passes `guard.admit` (drain, API key, sizes) and the endpoint carries ``access``;
    `route` (the path template) and the renderer's protocol go to the request's access facts."""

    @functools.wraps(endpoint)
    async def run(request: Request) -> Response:
        if route is not None:
            request_context.note(route=route)
        request_context.note(protocol=renderer.protocol)
        try:
            if access is not None:
                request = admit(request, access, renderer.key_header)
            return await endpoint(request)
        except LmiServeError as exc:
            return renderer.response(exc, request)

    if access is not None:  # what the route-table audit reads
        run.access = access  # type: ignore[attr-defined]
        run.renderer = renderer  # type: ignore[attr-defined]
    return run


def protocol_routes(
    renderer: ErrorRenderer,
    routes: Sequence[BaseRoute],
    *,
    public: Sequence[BaseRoute] = (),
    live: Sequence[BaseRoute] = (),
) -> list[BaseRoute]:
    """The routes of one protocol (routes inside a `Mount` too), their endpoints answering lmiserve's
    errors with `renderer` after `guard.admit`: `routes` need the API key when one is set, `public`
    ones never do (health and readiness probes, and answers that do no work, such as OPTIONS), nor do
    `live` ones (liveness probes), which also answer while the server drains. All keep their order,
    `live` first, then `public`."""
    return [
        *_guarded(renderer, live, Access.LIVE),
        *_guarded(renderer, public, Access.OPEN),
        *_guarded(renderer, routes, Access.KEY),
    ]


def _guarded(renderer: ErrorRenderer, routes: Sequence[BaseRoute], access: Access, prefix: str = "") -> list[BaseRoute]:
    out: list[BaseRoute] = []
    for route in routes:
        if isinstance(route, Route):
            endpoint = rendered_by(renderer, route.endpoint, access, prefix + route.path)
            guarded: BaseRoute = Route(route.path, endpoint, methods=route.methods, name=route.name)
        elif isinstance(route, Mount):
            inner = _guarded(renderer, route.routes, access, prefix + route.path)
            guarded = Mount(route.path, routes=inner, name=route.name)
        else:
            raise TypeError(f"cannot guard {route!r}: register Route or Mount objects")
        if hasattr(route, ATTRIBUTE):  # its operations in the API document (server/apidoc.py)
            setattr(guarded, ATTRIBUTE, getattr(route, ATTRIBUTE))
        out.append(guarded)
    return out
