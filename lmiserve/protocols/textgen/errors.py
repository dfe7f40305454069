"""The error answers TGI gives, which its OpenAI-compatible routes give too: the base of both
protocols' renderers (`protocols/tgi/errors.py`, `protocols/openai/errors.py`).

- Body rejections are plain text, the message being the whole body: 415 (not application/json),
  413 (payload limit), 400 (not JSON), 422 (does not fit the schema).
- A missing or wrong API key is a bare 401 with an empty body.
- Everything else is ``{"error": "<message>", "error_type": "<kind>"}`` (compact JSON): validation
  422 ``Input validation error: ...``, chat template 422 ``Template error: ...``, tools 422
  ``Tool error: ...``, overload 429 ``Model is overloaded``, not ready 503 ``unhealthy``, an incomplete
  answer 500 ``Incomplete generation``, and any failure once generation started (the engine's queue
  timeout included) 424 ``Request failed during generation: ...``.
- No text-generation model served (`NoTextModel`): 404 ``{"error": "No text-generation model is
  loaded: this route needs an LLM.", "error_type": "not_found"}``.
- An unknown LoRA adapter (`AdapterNotFound`, TGI's `parameters.adapter_id`): 404 ``{"error": "`adapter_id`
  names adapter `x`, which is not served", "error_type": "not_found"}``, checked before a native stream
  starts (a response, not an in-band event). TGI itself would answer with the base model.
- `ModelRequired` (several LLMs and no way to pick one) is not answered here: it goes on to the
  application's catch-all handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import (
    AdapterNotFound,
    GenerationFailed,
    HeadersTooLarge,
    IncompleteGeneration,
    InvalidRequest,
    LmiServeError,
    MalformedBody,
    ModelNotReady,
    ModelRequired,
    NoTextModel,
    Overloaded,
    PayloadTooLarge,
    SchemaViolation,
    TemplateError,
    Unauthorized,
    Unsupported,
    UnsupportedMediaType,
)
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server.apidoc import JSON, STRING, TEXT, Reply
from lmiserve.server.errors import ErrorRenderer, lookup
from lmiserve.server.responses import raw_response

PLAIN = "text/plain; charset=utf-8"
GENERATION_PREFIX = "Request failed during generation: "


@dataclass(frozen=True)
class Shape:
    """One error's JSON answer: status, ``error_type``, and its message (a prefix before the
    exception's message, or a fixed text instead of it)."""

    status: int
    kind: str
    prefix: str = ""
    fixed: str | None = None


class ToolError(InvalidRequest):
    """`tools`, `tool_choice` or a tool message that cannot be used (TGI's 422 ``tool_error``)."""


SHAPES: dict[type[LmiServeError], Shape] = {
    LmiServeError: Shape(424, "generation", GENERATION_PREFIX),
    GenerationFailed: Shape(424, "generation", GENERATION_PREFIX),
    IncompleteGeneration: Shape(500, "incomplete_generation", fixed="Incomplete generation"),
    InvalidRequest: Shape(422, "validation", "Input validation error: "),
    TemplateError: Shape(422, "template_error", "Template error: "),
    Unsupported: Shape(422, "tool_error", "Tool error: "),
    ToolError: Shape(422, "tool_error", "Tool error: "),
    Overloaded: Shape(429, "overloaded", fixed="Model is overloaded"),
    ModelNotReady: Shape(503, "unhealthy"),
    NoTextModel: Shape(404, "not_found"),
    AdapterNotFound: Shape(404, "not_found"),
}

REJECTIONS: dict[type[LmiServeError], int] = {
    UnsupportedMediaType: 415,
    PayloadTooLarge: 413,
    HeadersTooLarge: 431,
    MalformedBody: 400,
    SchemaViolation: 422,
}


class TgiError(BaseModel):
    """TGI's error object."""

    error: str
    error_type: str


class TextGenRenderer(ErrorRenderer):
    """TGI's error answers; subclasses add their protocol's in-band errors (and shapes)."""

    shapes: ClassVar[dict[type[LmiServeError], Shape]] = SHAPES

    def shape(self, exc: LmiServeError) -> Shape:
        return lookup(exc, self.shapes, self.shapes[LmiServeError])

    def message(self, exc: LmiServeError) -> str:
        """The ``error`` text of `exc`."""
        shape = self.shape(exc)
        return shape.fixed if shape.fixed is not None else shape.prefix + exc.message

    def kind(self, exc: LmiServeError) -> str:
        """The ``error_type`` of `exc`."""
        return self.shape(exc).kind

    @staticmethod
    def is_rejection(exc: LmiServeError) -> bool:
        """A plain-text body rejection or the bare 401: answered before a handler would run."""
        return isinstance(exc, Unauthorized) or lookup(exc, REJECTIONS, None) is not None

    def status(self, exc: LmiServeError) -> int:
        if isinstance(exc, Unauthorized):
            return 401
        rejection = lookup(exc, REJECTIONS, None)
        return rejection if rejection is not None else self.shape(exc).status

    def body(self, exc: LmiServeError) -> bytes:
        if isinstance(exc, Unauthorized):
            return b""
        if lookup(exc, REJECTIONS, None) is not None:
            return exc.message.encode()
        return dumps({"error": self.message(exc), "error_type": self.kind(exc)})

    def documented(self) -> dict[int, Reply]:
        plain = {TEXT: STRING}
        replies = {status: Reply("Body rejected (plain text)", plain) for status in REJECTIONS.values()}
        replies[401] = Reply("Missing or wrong API key (no body)")
        for shape in self.shapes.values():
            content = {**replies[shape.status].content, JSON: TgiError} if shape.status in replies else {JSON: TgiError}
            replies[shape.status] = Reply("Error", content)
        return replies

    def response(self, exc: LmiServeError, request: Request) -> Response:
        if isinstance(exc, ModelRequired):
            raise exc  # not a TGI situation: the application's catch-all answers it
        if isinstance(exc, Unauthorized):
            return Response(status_code=401)  # no content type at all
        if lookup(exc, REJECTIONS, None) is not None:
            return raw_response(self.body(exc), self.status(exc), PLAIN)
        return super().response(exc, request)
