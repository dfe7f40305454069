"""Hugging Face text-embeddings-inference's error answers on its routes (/embed, /rerank).

- Body rejections are plain text, the message being the whole body (axum's): 415 (not
  application/json), 413 (payload limit), 400 (not JSON), 422 (does not fit the schema), 431 (headers).
- A missing or wrong API key is a bare 401 with an empty body.
- Everything else is ``{"error": "<message>", "error_type": "<kind>"}`` (compact JSON) with TEI's
  statuses: ``Validation`` 413 (an input longer than the model takes without ``truncate``, too many
  inputs, a value the model cannot honour such as ``dimensions``), ``Empty`` 400 (no input at all),
  ``Backend`` 400 (the served model is not of the route's kind: "model is not a re-ranker model"),
  ``Overloaded`` 429, ``Unhealthy`` 503 (loading, failed, draining), ``Backend`` 500 (the model failed).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import (
    GenerationFailed,
    HeadersTooLarge,
    InvalidRequest,
    LmiServeError,
    MalformedBody,
    ModelNotFound,
    ModelNotReady,
    ModelRequired,
    Overloaded,
    PayloadTooLarge,
    SchemaViolation,
    Unauthorized,
    UnsupportedMediaType,
)
from lmiserve.models.text_encoders import MAX_INPUTS, InputTooLong, TooManyInputs, WrongModelKind
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server.apidoc import JSON, STRING, TEXT, Reply
from lmiserve.server.errors import ErrorRenderer, lookup
from lmiserve.server.responses import raw_response

PLAIN = "text/plain; charset=utf-8"


class EmptyBatch(InvalidRequest):
    """No input at all (TEI's ``Empty``)."""


@dataclass(frozen=True)
class Kind:
    status: int
    error_type: str


KINDS: dict[type[LmiServeError], Kind] = {
    LmiServeError: Kind(500, "Backend"),
    GenerationFailed: Kind(500, "Backend"),
    InvalidRequest: Kind(413, "Validation"),
    EmptyBatch: Kind(400, "Empty"),
    WrongModelKind: Kind(400, "Backend"),
    ModelNotFound: Kind(400, "Backend"),
    ModelRequired: Kind(400, "Validation"),
    Overloaded: Kind(429, "Overloaded"),
    ModelNotReady: Kind(503, "Unhealthy"),
}
REJECTIONS: dict[type[LmiServeError], int] = {
    UnsupportedMediaType: 415,
    PayloadTooLarge: 413,
    HeadersTooLarge: 431,
    MalformedBody: 400,
    SchemaViolation: 422,
}


class TeiError(BaseModel):
    """TEI's error object."""

    error: str
    error_type: str


class TeiRenderer(ErrorRenderer):
    protocol = "tei"

    def kind(self, exc: LmiServeError) -> Kind:
        return lookup(exc, KINDS, KINDS[LmiServeError])

    def message(self, exc: LmiServeError) -> str:
        if isinstance(exc, InputTooLong):
            return (
                f"Input validation error: `inputs` must have less than {exc.max_input} tokens. "
                f"Given: {exc.input_tokens}"
            )
        if isinstance(exc, TooManyInputs):
            return f"batch size {exc.count} > maximum allowed batch size {MAX_INPUTS}"
        if isinstance(exc, ModelNotReady):
            return exc.message or "unhealthy"
        if isinstance(exc, InvalidRequest) and self.kind(exc).error_type == "Validation":
            return f"Input validation error: {exc.message}"
        return exc.message

    def status(self, exc: LmiServeError) -> int:
        if isinstance(exc, Unauthorized):
            return 401
        rejection = lookup(exc, REJECTIONS, None)
        return rejection if rejection is not None else self.kind(exc).status

    def body(self, exc: LmiServeError) -> bytes:
        if isinstance(exc, Unauthorized):
            return b""
        if lookup(exc, REJECTIONS, None) is not None:
            return exc.message.encode()
        return dumps({"error": self.message(exc), "error_type": self.kind(exc).error_type})

    def response(self, exc: LmiServeError, request: Request) -> Response:
        if isinstance(exc, Unauthorized):
            return Response(status_code=401)
        if lookup(exc, REJECTIONS, None) is not None:
            return raw_response(self.body(exc), self.status(exc), PLAIN)
        return super().response(exc, request)

    def documented(self) -> dict[int, Reply]:
        replies = {status: Reply("Body rejected (plain text)", {TEXT: STRING}) for status in REJECTIONS.values()}
        replies[401] = Reply("Missing or wrong API key (no body)")
        for kind in KINDS.values():
            content = {**replies[kind.status].content, JSON: TeiError} if kind.status in replies else {JSON: TeiError}
            replies[kind.status] = Reply("Error (TEI's error object)", content)
        return replies


RENDERER = TeiRenderer()
