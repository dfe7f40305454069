"""KServe V2 errors: JSON ``{"error": msg}`` with the tensor protocols' statuses (invalid input 400,
unknown model or version 404, not ready 503, ...). A started `generate_stream` ends with the error as
its last SSE event, ``data: {"error": msg}``. The readiness routes (`/v2/health/ready`,
`/v2/models/{m}[/versions/{v}]/ready`) say ``"ready": false`` beside the message when they answer 503
(not ready, or the server drains): ``{"error": msg, "ready": false}``."""

from __future__ import annotations

import json

from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.tensor.errors import JsonErrorRenderer, TensorError
from lmiserve.server import sse
from lmiserve.server.apidoc import JSON, Reply


class KServeErrorRenderer(JsonErrorRenderer):
    protocol = "kserve"

    def in_band(self, exc: LmiServeError) -> bytes:
        return sse.event(self.body(exc))


class NotReady(TensorError):
    """A readiness route's 503."""

    ready: bool = False


class ReadinessRenderer(KServeErrorRenderer):
    """KServe's errors, with ``"ready": false`` in a 503 (not ready, draining)."""

    def body(self, exc: LmiServeError) -> bytes:
        if self.status(exc) != 503:
            return super().body(exc)
        return json.dumps({"error": exc.message, "ready": False}, ensure_ascii=False).encode("utf-8")

    def documented(self) -> dict[int, Reply]:
        return {**super().documented(), 503: Reply("Not ready, or the server drains", {JSON: NotReady})}


RENDERER = KServeErrorRenderer()
READINESS = ReadinessRenderer()
