"""The OpenAI-compatible routes' error answers: OpenAI's error object, always ``application/json``
(compact JSON), so the `openai` SDK raises the exception class of the status::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

- 400 ``invalid_request_error``: any invalid request (not JSON, not the schema, a value out of range, a
  chat template or tool that cannot be used (``Template error: ...``, ``Tool error: ...``), an
  unsupported option such as ``suffix``), SDK ``BadRequestError``. Body rejections keep their own
  status: 413 (payload limit), 415 (not application/json), 431 (headers too large).
- 401 ``authentication_error`` / ``invalid_api_key``: a missing or wrong API key.
- 403 ``permission_error``: a LoRA adapter path outside model_store and allowed_model_paths
  (``/v1/load_lora_adapter``), SDK ``PermissionDeniedError``.
- 404 ``not_found_error`` / ``model_not_found`` (``param: "model"``): a `model` that names nothing
  served (neither a model nor a LoRA adapter of one), or a server without a text-generation model;
  404 ``invalid_request_error``: a stored response that does not exist (``GET``/``DELETE
  /v1/responses/{id}``; ``previous_response_id``, then with ``param`` and ``code:
  "previous_response_not_found"``).
- 429 ``rate_limit_error``: overloaded (the queue is full, every admission slot taken).
- 503 ``service_unavailable_error``: the model is loading, failed, the server drains, or a request
  waited past ``predict_timeout`` for a slot.
- 500 ``server_error``: the model failed on a valid request, or the answer is incomplete.

Once a stream started, the error is the same object as one last event, then ``data: [DONE]``.
See docs/protocols/openai.md, "Errors".
"""

from __future__ import annotations

import re
from typing import ClassVar, NamedTuple

from lmiserve.core.errors import (
    AdapterNotFound,
    ContextLengthExceeded,
    Forbidden,
    GenerationFailed,
    HeadersTooLarge,
    InvalidRequest,
    LmiServeError,
    ModelNotFound,
    ModelNotReady,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QueueTimeout,
    SchemaViolation,
    TemplateError,
    Unauthorized,
    Unsupported,
    UnsupportedMediaType,
    excerpt,
)
from lmiserve.protocols.openai import responses
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import sse
from lmiserve.server.apidoc import JSON, Reply
from lmiserve.server.errors import ErrorRenderer, lookup

DONE = b"data: [DONE]\n\n"  # the last event of every OpenAI stream
_FIELD = re.compile(r"^`(\w+)`")  # a validation message that starts with the field it is about
_SCHEMA_FIELD = re.compile(r"target type: (\w+)")  # SchemaViolation: the first field pydantic named


class EmptyPrompt(InvalidRequest):
    """A completions request whose prompt is an empty array."""


class TooManyPrompts(InvalidRequest):
    """More prompts in one completions request than the engine's max_num_seqs (`max_rolling_batch_size`)."""


class FieldError(InvalidRequest):
    """An invalid request about one field, which `param` names (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class IgnoredFields(FieldError):
    """Fields the server would accept and ignore (openai.fields), refused under `strict_openai_fields`;
    `param` names the first. At most 5 names are quoted (40 characters each), then how many more."""

    SHOWN = 5

    def __init__(self, names: list[str]):
        shown = ", ".join(f"`{excerpt(name, 40)}`" for name in names[: self.SHOWN])
        more = f" and {len(names) - self.SHOWN} more" if len(names) > self.SHOWN else ""
        super().__init__(
            f"The following fields are not supported and would be ignored (the server's strict_openai_fields "
            f"refuses them): {shown}{more}",
            excerpt(names[0], 40),
        )
        self.names = names


class SuffixUnsupported(Unsupported):
    """A completions request with a `suffix`."""


class InvalidValue(InvalidRequest):
    """A field holding a value outside its allowed set (OpenAI's ``invalid_value``); `param` names it as
    OpenAI does (``messages[2].role``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class PreviousResponseNotFound(NotFound):
    """A `previous_response_id` that names no stored response (the Responses API)."""


class ContextWindowExceeded(InvalidRequest):
    """The prompt (and `max_tokens`) over the model's context, in OpenAI's words and with its code
    ``context_length_exceeded`` (clients such as litellm and langchain recognise it)."""

    def __init__(self, exc: ContextLengthExceeded, param: str):
        unit = "messages" if param == "messages" else "prompt"
        if exc.input_tokens > exc.max_input:
            message = (
                f"This model's maximum context length is {exc.max_total} tokens (at most {exc.max_input} in the "
                f"{unit}). However, your {unit} resulted in {exc.input_tokens} tokens. Please reduce the length "
                f"of the {unit}."
            )
        else:
            total = exc.input_tokens + exc.max_new_tokens
            message = (
                f"This model's maximum context length is {exc.max_total} tokens. However, you requested {total} "
                f"tokens ({exc.input_tokens} in the {unit}, {exc.max_new_tokens} in the completion). Please "
                f"reduce the length of the {unit} or completion."
            )
        super().__init__(message)
        self.param = param


class Kind(NamedTuple):
    status: int
    type: str
    code: str | None = None
    fixed: str | None = None  # a message instead of the exception's own (when it has none)
    prefix: str = ""  # before the exception's message


KINDS: dict[type[LmiServeError], Kind] = {
    LmiServeError: Kind(500, "server_error"),
    GenerationFailed: Kind(500, "server_error"),
    InvalidRequest: Kind(400, "invalid_request_error"),
    Unsupported: Kind(400, "invalid_request_error"),
    TemplateError: Kind(400, "invalid_request_error", prefix="Template error: "),
    ToolError: Kind(400, "invalid_request_error", prefix="Tool error: "),
    PayloadTooLarge: Kind(413, "invalid_request_error"),
    UnsupportedMediaType: Kind(415, "invalid_request_error"),
    HeadersTooLarge: Kind(431, "invalid_request_error"),
    Unauthorized: Kind(401, "authentication_error", "invalid_api_key", "Invalid or missing API key."),
    Forbidden: Kind(403, "permission_error"),
    ModelNotFound: Kind(404, "not_found_error", "model_not_found"),
    AdapterNotFound: Kind(404, "not_found_error", "model_not_found"),  # `model` names the adapter
    NotFound: Kind(404, "invalid_request_error"),
    PreviousResponseNotFound: Kind(404, "invalid_request_error", "previous_response_not_found"),
    InvalidValue: Kind(400, "invalid_request_error", "invalid_value"),
    ContextWindowExceeded: Kind(400, "invalid_request_error", "context_length_exceeded"),
    Overloaded: Kind(429, "rate_limit_error", None, "The server is overloaded, please retry later."),
    ModelNotReady: Kind(503, "service_unavailable_error", None, "The model is not ready."),
    QueueTimeout: Kind(503, "service_unavailable_error"),
}


def param(exc: LmiServeError) -> str | None:
    """The request field an error is about, when its message says it (else None)."""
    if isinstance(exc, (InvalidValue, ContextWindowExceeded, FieldError)):
        return exc.param
    if isinstance(exc, (ModelNotFound, AdapterNotFound)):
        return "model"
    if isinstance(exc, PreviousResponseNotFound):
        return "previous_response_id"
    if isinstance(exc, SchemaViolation):
        found = _SCHEMA_FIELD.search(exc.message)
        return found.group(1) if found and found.group(1) != "body" else None
    if isinstance(exc, InvalidRequest):
        found = _FIELD.match(exc.message)
        return found.group(1) if found else None
    return None


class OpenAIRenderer(ErrorRenderer):
    protocol = "openai"
    kinds: ClassVar[dict[type[LmiServeError], Kind]] = KINDS

    def kind(self, exc: LmiServeError) -> Kind:
        return lookup(exc, self.kinds, self.kinds[LmiServeError])

    def message(self, exc: LmiServeError) -> str:
        kind = self.kind(exc)
        return kind.prefix + (exc.message or kind.fixed or type(exc).__name__)

    def status(self, exc: LmiServeError) -> int:
        return self.kind(exc).status

    def error(self, exc: LmiServeError) -> dict[str, dict[str, str | None]]:
        """OpenAI's error object of `exc`."""
        kind = self.kind(exc)
        return {"error": {"message": self.message(exc), "type": kind.type, "param": param(exc), "code": kind.code}}

    def body(self, exc: LmiServeError) -> bytes:
        return dumps(self.error(exc))

    def in_band(self, exc: LmiServeError) -> bytes:
        return sse.event(self.body(exc)) + DONE

    def documented(self) -> dict[int, Reply]:
        reply = Reply("Error (OpenAI's error object)", {JSON: responses.OpenAIError})
        return {kind.status: reply for kind in self.kinds.values()}


RENDERER = OpenAIRenderer()


def model_not_found(name: str | None) -> ModelNotFound:
    """The 404 of a `model` that names neither the served model nor a LoRA adapter of it."""
    return ModelNotFound(f"The model `{excerpt(name or '')}` does not exist.")
