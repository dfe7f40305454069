"""TGI's error answers (see `lmiserve.protocols.textgen.errors` for the shapes it shares with the OpenAI
routes), and its native streams' in-band errors.

A native stream (/generate_stream, and POST / with ``stream: true``) answers every error found once
its body was read in-band under 200: one ``data: {"error": ..., "error_type": ...}`` event, then
the end of the stream. Only "not ready" (503) and the body rejections stay ordinary responses.
An answer that ended before its final token event is ``Incomplete generation stream``
(``incomplete_generation_stream``) in a stream.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import IncompleteGeneration, LmiServeError, ModelNotReady, ModelRequired
from lmiserve.protocols.textgen.errors import TextGenRenderer
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, SSE_HEADERS, dumps
from lmiserve.server import sse
from lmiserve.server.responses import raw_response

_IN_BAND = "tgi_errors_in_band"


def errors_in_band(request: Request) -> None:
    """From now on this request is a native stream: its errors are answered in-band under 200."""
    setattr(request.state, _IN_BAND, True)


class TgiRenderer(TextGenRenderer):
    protocol = "tgi"

    def in_band(self, exc: LmiServeError) -> bytes:
        if isinstance(exc, IncompleteGeneration):
            return sse.event(
                dumps({"error": "Incomplete generation stream", "error_type": "incomplete_generation_stream"})
            )
        return sse.event(self.body(exc))

    def response(self, exc: LmiServeError, request: Request) -> Response:
        streaming = getattr(request.state, _IN_BAND, False)
        if streaming and not isinstance(exc, (ModelNotReady, ModelRequired)) and not self.is_rejection(exc):
            return raw_response(self.in_band(exc), 200, SSE_CONTENT_TYPE, SSE_HEADERS)
        return super().response(exc, request)


RENDERER = TgiRenderer()
