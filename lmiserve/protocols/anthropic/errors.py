"""The Anthropic routes' error answers: Anthropic's error object, always ``application/json`` (compact
JSON), so the `anthropic` SDK raises the exception class of the status::

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

- 400 ``invalid_request_error``: any invalid request: not JSON, not JSON at all (any content type but
  ``application/json``), not the schema (``<field path>: <what is wrong>``), a value out of range, a
  block the model cannot take (``image``, ``document``), a chat template or tool that cannot be used
  (``Template error: ...``, ``Tool error: ...``), a prompt over the model's context; SDK ``BadRequestError``.
- 401 ``authentication_error``: a missing or wrong API key (``x-api-key`` or ``Authorization: Bearer``).
- 404 ``not_found_error``: a `model` that names nothing served (neither a model nor a LoRA adapter of
  one), or a server without a text-generation model.
- 413 ``request_too_large``: a body over ``max_request_size`` or ``payload_limit``; 431 for headers over
  ``max_header_size`` (``invalid_request_error``).
- 529 ``overloaded_error``: every admission slot is taken, or a request waited past ``predict_timeout``.
- 503 ``overloaded_error``: the model is loading, failed to load, or the server drains (a status load
  balancers read as "not here, now").
- 500 ``api_error``: the model failed on a valid request, or the answer is incomplete.

Once a stream started, the error is an ``event: error`` with the same object, the stream's last event.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from lmiserve.core.errors import (
    HeadersTooLarge,
    InvalidRequest,
    LmiServeError,
    ModelNotFound,
    ModelNotReady,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QueueTimeout,
    TemplateError,
    Unauthorized,
    Unsupported,
)
from lmiserve.protocols.anthropic import responses
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server.apidoc import JSON, Reply
from lmiserve.server.errors import ErrorRenderer, lookup


class Kind(NamedTuple):
    status: int
    type: str
    fixed: str | None = None  # the message instead of the exception's own
    prefix: str = ""  # before the exception's message


KINDS: dict[type[LmiServeError], Kind] = {
    LmiServeError: Kind(500, "api_error"),
    InvalidRequest: Kind(400, "invalid_request_error"),
    Unsupported: Kind(400, "invalid_request_error"),
    TemplateError: Kind(400, "invalid_request_error", prefix="Template error: "),
    ToolError: Kind(400, "invalid_request_error", prefix="Tool error: "),
    PayloadTooLarge: Kind(413, "request_too_large"),
    HeadersTooLarge: Kind(431, "invalid_request_error"),
    Unauthorized: Kind(401, "authentication_error", "invalid x-api-key"),
    ModelNotFound: Kind(404, "not_found_error"),
    NotFound: Kind(404, "not_found_error"),  # a LoRA adapter gone between the check and the generation
    Overloaded: Kind(529, "overloaded_error", "Overloaded"),
    QueueTimeout: Kind(529, "overloaded_error"),
    ModelNotReady: Kind(503, "overloaded_error"),
}


def event(name: str, data: bytes) -> bytes:
    """One server-sent event as Anthropic writes them: an ``event:`` line, then one ``data:`` line."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class AnthropicRenderer(ErrorRenderer):
    protocol = "anthropic"
    key_header = "x-api-key"  # Anthropic's clients send the key there (Authorization: Bearer works too)
    kinds: ClassVar[dict[type[LmiServeError], Kind]] = KINDS

    def kind(self, exc: LmiServeError) -> Kind:
        return lookup(exc, self.kinds, self.kinds[LmiServeError])

    def message(self, exc: LmiServeError) -> str:
        kind = self.kind(exc)
        if kind.fixed is not None:
            return kind.fixed
        return kind.prefix + (exc.message or type(exc).__name__)

    def status(self, exc: LmiServeError) -> int:
        return self.kind(exc).status

    def body(self, exc: LmiServeError) -> bytes:
        return dumps({"type": "error", "error": {"type": self.kind(exc).type, "message": self.message(exc)}})

    def in_band(self, exc: LmiServeError) -> bytes:
        return event("error", self.body(exc))

    def documented(self) -> dict[int, Reply]:
        reply = Reply("Error (Anthropic's error object)", {JSON: responses.ErrorResponse})
        return {kind.status: reply for kind in self.kinds.values()}


RENDERER = AnthropicRenderer()
