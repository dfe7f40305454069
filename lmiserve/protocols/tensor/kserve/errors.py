"""KServe V2 errors: JSON ``{"error": msg}`` with the tensor protocols' statuses (invalid input 400,
unknown model or version 404, not ready 503, ...). A started `generate_stream` ends with the error as
its last SSE event, ``data: {"error": msg}``."""

from __future__ import annotations

from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.tensor.errors import JsonErrorRenderer
from lmiserve.server import sse


class KServeErrorRenderer(JsonErrorRenderer):
    protocol = "kserve"

    def in_band(self, exc: LmiServeError) -> bytes:
        return sse.event(self.body(exc))


RENDERER = KServeErrorRenderer()
