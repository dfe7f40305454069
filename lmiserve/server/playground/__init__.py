"""The playground: one small page at ``GET /playground`` to chat with the served LLM (streamed from
``/v1/chat/completions``) beside a live view of its batch (``GET /playground/stats``, server-sent
events, see `stats`).

The page and its script and style ship in this package (no external asset, no build step) and are
served with a Content-Security-Policy that allows this origin only. They do no work and reveal nothing,
so they are open like the health probes; the stats stream shows live server state and needs the API
key when one is set (the page sends the key it was given, kept in the tab's sessionStorage).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from lmiserve.config import Settings
from lmiserve.core.errors import HeadersTooLarge, LmiServeError, PayloadTooLarge, Unauthorized
from lmiserve.server import apidoc
from lmiserve.server.errors import ErrorRenderer, lookup, protocol_routes
from lmiserve.server.playground.stats import TokenRate, events
from lmiserve.server.responses import raw_response

PATH = "/playground"
ASSETS = {  # file of this package -> content type
    "playground.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
}
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class PlaygroundErrors(ErrorRenderer):
    """The errors these routes can meet (the guard's), as ``{"error": {"message", "type"}}``: the shape
    of OpenAI's errors, which the page reads from the chat route too."""

    protocol_name = "playground"

    def status(self, exc: LmiServeError) -> int:
        return lookup(exc, {Unauthorized: 401, PayloadTooLarge: 413, HeadersTooLarge: 431}, 500)

    def body(self, exc: LmiServeError) -> bytes:
        kind = type(exc).__name__
        return json.dumps({"error": {"message": exc.message, "type": kind}}).encode("utf-8")


RENDERER = PlaygroundErrors()


@cache
def asset(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def url(settings: Settings) -> str:
    """Where the page is, for the startup log: a wildcard bind address is shown as localhost."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}{PATH}"


def _file(name: str) -> BaseRoute:
    path = PATH if name == "playground.html" else f"{PATH}/{name}"

    async def serve(request: Request) -> Response:
        return raw_response(asset(name), 200, ASSETS[name], HEADERS)

    serve.__name__ = f"playground_{name.replace('.', '_')}"
    route = Route(path, serve, methods=["GET"])
    if name != "playground.html":
        return apidoc.hidden(route)  # the page's own files
    page = apidoc.Operation(
        "The playground: a chat and a live batch view",
        "Playground",
        apidoc.ok("An HTML page", {"text/html": apidoc.STRING}),
    )
    return apidoc.document(route, page)


def routes() -> list[BaseRoute]:
    """The page and its files (open) and the stats stream (needs the API key when one is set)."""
    rates = TokenRate()

    async def stats(request: Request) -> Response:
        registry = request.app.state.registry
        return StreamingResponse(
            events(lambda: registry, rates), media_type="text/event-stream", headers=STREAM_HEADERS
        )

    live = apidoc.Operation(
        "The playground's live batch view",
        "Playground",
        apidoc.ok(
            "Server-sent events, about two a second, each a JSON object of the served models' batch",
            {apidoc.SSE: {"type": "object"}},
        ),
    )
    stats_route = apidoc.document(Route(f"{PATH}/stats", stats, methods=["GET"]), live)
    return protocol_routes(RENDERER, [stats_route], public=[_file(name) for name in ASSETS])
