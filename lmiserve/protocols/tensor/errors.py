"""The tensor protocols' error shape: JSON ``{"error": "<message>"}``, with statuses shared by KServe V2,
TF Serving, SageMaker and Vertex AI. Each protocol has its renderer (its folder's `errors.py`), built on
`JsonErrorRenderer`; TF Serving pretty-prints the same object.

Statuses: a bad request 400 (an unparsable body, a document that breaks the schema, tensors that do
not fit the model), unknown model or version 404, unacceptable Accept 406, unsupported Content-Type or
Content-Encoding 415, a feature not implemented 501, not ready / overloaded / queue timeout 503, a
failure inside the model or of the server 500.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from lmiserve.core.errors import (
    Conflict,
    GenerationFailed,
    HeadersTooLarge,
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
from lmiserve.server.apidoc import JSON, Reply
from lmiserve.server.errors import ErrorRenderer, lookup

STATUS: dict[type[LmiServeError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    NotFound: 404,
    NotAcceptable: 406,
    Conflict: 409,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    HeadersTooLarge: 431,
    Unsupported: 501,
    ModelNotReady: 503,
    Overloaded: 503,
    QueueTimeout: 503,
    GenerationFailed: 500,
    InternalError: 500,
}


def error_json(message: str) -> bytes:
    """``{"error": message}``, compact, UTF-8 (not ASCII-escaped)."""
    return json.dumps({"error": message}, ensure_ascii=False).encode("utf-8")


class TensorError(BaseModel):
    """The tensor protocols' error object."""

    error: str


class JsonErrorRenderer(ErrorRenderer):
    """``{"error": msg}`` with the tensor protocols' statuses."""

    protocol = "tensor"

    def documented(self) -> dict[int, Reply]:
        return {status: Reply("Error", {JSON: TensorError}) for status in sorted({*STATUS.values(), 500})}

    def status(self, exc: LmiServeError) -> int:
        return lookup(exc, STATUS, 500)

    def body(self, exc: LmiServeError) -> bytes:
        return error_json(exc.message)


RENDERER = JsonErrorRenderer()
