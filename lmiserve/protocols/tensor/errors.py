"""Error shapes of the tensor protocols: KServe V2, SageMaker and Vertex AI answer JSON
``{"error": "<message>"}``; TF Serving the same object pretty-printed (its own renderer).

Statuses: invalid input 400, unknown model or version 404, unacceptable Accept 406, unsupported
Content-Type 415, a feature not implemented 501, not ready / overloaded / queue timeout 503, a failure
inside the model or of the server 500.
"""

from __future__ import annotations

import json

from lmiserve.core.errors import (
    Conflict,
    GenerationFailed,
    InternalError,
    InvalidRequest,
    LmiServeError,
    ModelNotReady,
    NotAcceptable,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QueueTimeout,
    Unauthorized,
    Unsupported,
    UnsupportedMediaType,
)
from lmiserve.server.errors import ErrorRenderer, lookup

STATUS: dict[type[LmiServeError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    NotFound: 404,
    NotAcceptable: 406,
    Conflict: 409,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    Unsupported: 501,
    ModelNotReady: 503,
    Overloaded: 503,
    QueueTimeout: 503,
    GenerationFailed: 500,
    InternalError: 500,
}


class JsonErrorRenderer(ErrorRenderer):
    """``{"error": msg}`` with the tensor protocols' statuses."""

    def status(self, exc: LmiServeError) -> int:
        legacy = getattr(exc, "tensor_status", None)  # TRANSITIONAL: TensorError(status=...) until it is gone
        return legacy if isinstance(legacy, int) else lookup(exc, STATUS)

    def body(self, exc: LmiServeError) -> bytes:
        return json.dumps({"error": exc.message}, ensure_ascii=False).encode("utf-8")


RENDERER = JsonErrorRenderer()
