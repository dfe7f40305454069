"""Request ids and the access line: one pure ASGI middleware around the whole application (outside
starlette's own error middleware, so an unforeseen 500 is covered too).

For every HTTP request it
- takes the client's request id from the first of `request_id_header_key` (default X-Request-Id),
  X-Request-Id, X-Amzn-SageMaker-Inference-Id and X-Amzn-RequestId that holds a usable one (1 to 200
  visible ASCII characters), else makes one (uuid4 hex);
- binds a `RequestFacts` (lmiserve.core.request_context) for the request's whole life, so every log
  line about it carries the id and the route, pipeline and model lookup note what they learn;
- echoes the id on the response, whatever answers it (errors, 401, 413 and 404 included): under
  X-Request-Id and `request_id_header_key`; when the client sent one, also under the header it came in
  and LMI's ``requestId``;
- writes one line to the ``lmiserve.access`` logger once the response is over (a stream when it ends
  or its client leaves: status 200, finish reason ``cancelled``): at INFO level, but at DEBUG for the
  health and readiness probes and metrics scrapes (`is_probe`), which orchestrators send every few seconds;
- with tracing on (lmiserve.server.tracing), records the request's span just before that line, which
  then names its ``trace_id``; probes and scrapes are not traced.

Nothing here runs per token: the pipeline notes the first token and the finish events only.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmiserve.core import request_context
from lmiserve.core.request_context import RequestFacts, new_request_id, usable_request_id

if TYPE_CHECKING:
    from lmiserve.server.tracing import Tracing

ACCESS_LOG = logging.getLogger("lmiserve.access")

REQUEST_ID = "X-Request-Id"
LMI_REQUEST_ID = "requestId"  # LMI's response header: the client's request id, when it sent one
ID_HEADERS = (REQUEST_ID, "X-Amzn-SageMaker-Inference-Id", "X-Amzn-RequestId")
_BARE = re.compile(r"[^\s\"=]+")


class RequestLog:
    """The middleware (see the module docstring). `header_key`: the request id header read first."""

    def __init__(
        self,
        app: ASGIApp,
        header_key: str = REQUEST_ID,
        on_done: Callable[[RequestFacts], None] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        """`on_done(facts)` is called once per request, after its access line (the request metrics);
        `tracing`: the server's, when tracing is configured (None: off, and no cost)."""
        self.app = app
        self.header_key = header_key
        self.on_done = on_done
        self.tracing = tracing
        names = [header_key, *ID_HEADERS]
        self._accepted = [(name.lower().encode("latin-1"), name) for name in dict.fromkeys(n.lower() for n in names)]
        self._names = {n.lower(): n for n in reversed(names)}  # as the configuration spells them

    def request_id(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, str | None]:
        """The client's id and the header it came in, else a new id and None."""
        sent = dict(headers)
        for raw, name in self._accepted:
            value = sent.get(raw, b"").decode("latin-1").strip()
            if usable_request_id(value):
                return value, self._names[name]
        return new_request_id(), None

    def echo(self, request_id: str, source: str | None) -> list[tuple[bytes, bytes]]:
        names = [REQUEST_ID, self.header_key]
        if source is not None:
            names += [source, LMI_REQUEST_ID]
        unique = dict.fromkeys(name.lower() for name in names)
        value = request_id.encode("latin-1")
        return [(name.encode("latin-1"), value) for name in unique]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, source = self.request_id(scope["headers"])
        facts = RequestFacts(request_id, method=scope["method"], path=scope["path"])
        echo = self.echo(request_id, source)
        echoed = {name for name, _ in echo}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                facts.status = message["status"]
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in echoed]
                message = {**message, "headers": [*kept, *echo]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                facts.completed = not facts.disconnected  # an answer to a client gone (499) reaches nobody
            await send(message)

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not facts.completed:
                facts.disconnected = True
            return message

        token = request_context.bind(facts)
        try:
            await self.app(scope, receiving, sending)
        finally:
            facts.end = time.monotonic()
            if facts.status is None:
                facts.status = 499 if facts.disconnected else 500
            if self.tracing is not None and not is_probe(facts):
                self.tracing.record_http(scope, facts)
            write_access_line(facts)
            if self.on_done is not None:
                self.on_done(facts)
            request_context.unbind(token)


# The probes' routes (the matched path templates) and methods: LMI's /ping, TGI's /health and GET /,
# KServe's liveness and readiness, Prometheus' scrape. Every Vertex AI GET route is its health route.
PROBE_ROUTES = frozenset(
    {
        "/ping",
        "/health",
        "/",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{model}/ready",
        "/v2/models/{model}/versions/{version}/ready",
        "/metrics",
    }
)
_PROBE_METHODS = frozenset({"GET", "HEAD"})


def is_probe(facts: RequestFacts) -> bool:
    """A health or readiness probe, or a metrics scrape: its access line is a DEBUG line."""
    if facts.method == "POST" and facts.route == "/ping":  # LMI's /ping answers POST too
        return True
    if facts.method not in _PROBE_METHODS:
        return False
    return facts.route in PROBE_ROUTES or facts.protocol == "vertex"


def write_access_line(facts: RequestFacts, probe: bool | None = None) -> None:
    """The request's one ``lmiserve.access`` line: logfmt text, its fields as ``extra={"access": ...}``
    (JSON logs write them as top-level keys); the request id is the line's own (see log_setup), and the
    text names the adapter only on requests that have one. INFO, or DEBUG for a probe (`probe`: the
    caller knows, e.g. gRPC's health RPCs; None: `is_probe`)."""
    fields = facts.fields()
    shown = {name: value for name, value in fields.items() if name != "request_id" and (name != "adapter" or value)}
    text = " ".join(f"{name}={_logfmt(value)}" for name, value in shown.items())
    level = logging.DEBUG if (is_probe(facts) if probe is None else probe) else logging.INFO
    ACCESS_LOG.log(level, text, extra={"access": fields, "request_id": facts.request_id})


def _logfmt(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return text if _BARE.fullmatch(text) else json.dumps(text, ensure_ascii=False)
