"""Request count and latency per protocol, model and status, for every route.

`RequestMetrics` is an ASGI middleware (installed once, in server/app.py). It times each HTTP request
from its arrival to the last byte of its response (a stream included) and reads what the route layer
noted in the request's scope: the protocol (the route group's renderer, `server.errors.rendered_by`)
and the model (`models.service.model_service` / `default_llm`). A request no route took (404) counts
under protocol ``none``; one that named no model, or an unknown one, under model ``""``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RequestCollectors:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "lmiserve_requests",
            "HTTP requests by protocol, model and response status.",
            ["protocol", "model", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "lmiserve_request_duration_seconds",
            "HTTP request duration in seconds, from arrival to the last byte of the response.",
            ["protocol", "model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    def observe(self, scope: Scope, status: int, seconds: float) -> None:
        noted = scope.get("lmiserve", {})
        protocol, model = noted.get("protocol", "none"), noted.get("model", "")
        self.requests.labels(protocol, model, str(status)).inc()
        self.duration.labels(protocol, model).observe(seconds)


class RequestMetrics:
    """ASGI middleware recording every HTTP request into `collectors`."""

    def __init__(self, app: ASGIApp, collectors: RequestCollectors) -> None:
        self.app = app
        self.collectors = collectors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 500  # no response started: the error handler outside answers 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.collectors.observe(scope, status, time.monotonic() - start)
