"""LMI's error shapes: the renderers of its inference routes and of its management API.

Bodies
- compact: ``{"error":"<msg>","code":424}``, error first, no spaces, no trailing newline. LMI writes it
  with Gson, which also escapes ``'`` and ``= < > &`` as ``\\u00XX``; we write the same JSON value
  with raw UTF-8 and without those escapes (any JSON parser reads both back to the same string).
- front-end: 2-space pretty JSON ``code, type, message`` followed by ``"\\n"`` (unknown paths and
  models, capacity, timeouts, management errors).
- dynamic batch (rolling_batch=disable): ``{"code": 424, "message": "invoke handler failure",
  "error": "<details>"}``. It is the body the formatter would send for a handler failure; over HTTP
  a failure before the first byte is answered with the compact body like every generation failure.

Inference routes (`LmiErrors`): invalid requests and generation failures are 424 with the compact
body; a LoRA adapter that is not served is 404 with the compact body (``"code": 404``); everything
else has a front-end status and type (see `STATUS` / `TYPE`); a full job queue adds
" for model: <name>" to the message when the model is known (`LmiErrors.for_model`); a body above
max_request_size is 413 RequestEntityTooLargeException; a missing or wrong API key a bare 401 (empty
body, as TGI answers on its /invocations).

In-band (a stream whose first bytes are out): the compact body with code 424, whatever the error;
the encoder frames it (JSON Lines: + "\\n"; SSE: "data: " + body + "\\n\\n").
"""

from __future__ import annotations

import json

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import (
    AdapterNotFound,
    Conflict,
    Forbidden,
    GenerationFailed,
    HeadersTooLarge,
    IncompleteGeneration,
    InternalError,
    InvalidRequest,
    LmiServeError,
    ModelNotFound,
    ModelNotReady,
    ModelRequired,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QueueTimeout,
    Unauthorized,
)
from lmiserve.server.apidoc import JSON, Reply
from lmiserve.server.errors import ErrorRenderer, lookup

__all__ = [
    "COMPACT_STATUS",
    "MANAGEMENT",
    "RENDERER",
    "LmiErrors",
    "ManagementErrors",
    "dynamic_batch_error_body",
    "frontend_error_body",
    "lmi_error_body",
]

COMPACT_STATUS = 424  # the status whose body is the compact one


def lmi_error_body(message: str, code: int = COMPACT_STATUS) -> bytes:
    """``{"error":"<message>","code":424}`` — compact, no trailing newline."""
    body = {"error": message, "code": code}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def frontend_error_body(code: int, type: str, message: str) -> bytes:
    """Front-end error: pretty-printed (2 spaces) ``code, type, message`` and a final newline."""
    body = {"code": code, "type": type, "message": message}
    return (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode()


def dynamic_batch_error_body(message: str, code: int = COMPACT_STATUS) -> bytes:
    """Dynamic-batch handler failure: ``{"code": 424, "message": "invoke handler failure", ...}``."""
    body = {"code": code, "message": "invoke handler failure", "error": message}
    return json.dumps(body, ensure_ascii=False).encode()


INTERNAL = "InternalServerException"


class CompactError(BaseModel):
    """``{"error": msg, "code": 424}``: an invalid request or a failed generation."""

    error: str
    code: int


class FrontendError(BaseModel):
    """The front end's error: ``code``, ``type`` (DJL's exception name) and ``message``."""

    code: int
    type: str
    message: str


# Inference routes. An IncompleteGeneration (an event stream that ended before its sequences finished)
# is a server failure: 500, as any unexpected error.
STATUS: dict[type[LmiServeError], int] = {
    InvalidRequest: COMPACT_STATUS,
    GenerationFailed: COMPACT_STATUS,
    ModelRequired: 400,
    PayloadTooLarge: 413,
    HeadersTooLarge: 431,
    Unauthorized: 401,
    QueueTimeout: 400,
    ModelNotFound: 404,
    AdapterNotFound: 404,
    ModelNotReady: 503,
    Overloaded: 503,
    IncompleteGeneration: 500,
}
# Not found, but about the body (a LoRA adapter it names): the compact body, with its own status.
COMPACT: tuple[type[LmiServeError], ...] = (AdapterNotFound,)
TYPE: dict[type[LmiServeError], str] = {
    ModelRequired: "BadRequestException",
    PayloadTooLarge: "RequestEntityTooLargeException",
    HeadersTooLarge: "RequestHeaderFieldsTooLargeException",
    QueueTimeout: "TranslateException",
    ModelNotFound: "ModelNotFoundException",
    ModelNotReady: "ServiceUnavailableException",
    Overloaded: "WlmCapacityException",
}


class LmiErrors(ErrorRenderer):
    """LMI's inference routes (/invocations, /predictions/{m}[/{v}], /models/{m}/invoke)."""

    protocol = "lmi"

    def __init__(self, model: str = ""):
        self.model = model  # named in the message of a full job queue

    def for_model(self, name: str) -> LmiErrors:
        return LmiErrors(name)

    def status(self, exc: LmiServeError) -> int:
        return lookup(exc, STATUS, 500)

    def body(self, exc: LmiServeError) -> bytes:
        status = self.status(exc)
        if status == COMPACT_STATUS or isinstance(exc, COMPACT):
            return lmi_error_body(exc.message, status)
        message = exc.message
        if isinstance(exc, Overloaded) and self.model:
            message = f"{message} for model: {self.model}"
        return frontend_error_body(status, lookup(exc, TYPE, INTERNAL), message)

    def response(self, exc: LmiServeError, request: Request) -> Response:
        if isinstance(exc, Unauthorized):
            return Response(status_code=401)  # bare, as TGI answers on its /invocations
        return super().response(exc, request)

    def in_band(self, exc: LmiServeError) -> bytes:
        return lmi_error_body(exc.message)

    def documented(self) -> dict[int, Reply]:
        replies = {status: Reply("Error", {JSON: FrontendError}) for status in sorted({*STATUS.values(), 500})}
        replies[COMPACT_STATUS] = Reply("Invalid request or failed generation", {JSON: CompactError})
        replies[404] = Reply(
            "No such model (front-end shape) or LoRA adapter (compact shape)", {JSON: FrontendError | CompactError}
        )
        replies[401] = Reply("Missing or wrong API key (no body)")
        return replies


# The management API: status and type.
MANAGEMENT_STATUS: dict[type[LmiServeError], tuple[int, str]] = {
    InvalidRequest: (400, "BadRequestException"),
    PayloadTooLarge: (413, "RequestEntityTooLargeException"),
    HeadersTooLarge: (431, "RequestHeaderFieldsTooLargeException"),
    Unauthorized: (401, "UnauthorizedException"),
    Forbidden: (403, "ForbiddenException"),
    ModelNotFound: (404, "ModelNotFoundException"),
    NotFound: (404, "ResourceNotFoundException"),  # an unknown adapter (the adapters API)
    Conflict: (409, "ConflictStatusException"),
    ModelNotReady: (503, "ServiceUnavailableException"),  # loading, failed, or the server drains
    InternalError: (500, INTERNAL),
}


class ManagementErrors(ErrorRenderer):
    """The management API (/models): always the front-end shape."""

    protocol = "lmi"

    def status(self, exc: LmiServeError) -> int:
        return lookup(exc, MANAGEMENT_STATUS, (500, INTERNAL))[0]

    def body(self, exc: LmiServeError) -> bytes:
        status, kind = lookup(exc, MANAGEMENT_STATUS, (500, INTERNAL))
        return frontend_error_body(status, kind, exc.message)

    def documented(self) -> dict[int, Reply]:
        return {status: Reply("Error", {JSON: FrontendError}) for status, _ in sorted(MANAGEMENT_STATUS.values())}


RENDERER = LmiErrors()
MANAGEMENT = ManagementErrors()
