"""Protocol-neutral errors: what went wrong, never how a protocol says it.

Nothing here carries an HTTP status or a wire name. Each protocol has one renderer
(`lmiserve.server.errors.ErrorRenderer` subclasses in `lmiserve/protocols/*/errors.py`) that maps
these classes to its status and body, registered once on the protocol's routes; the same renderer
writes the in-band error of a stream that has already started. Raise the most specific class; a
renderer matches on the class hierarchy (most specific first), so a protocol that does not tell two
cases apart simply maps their common base.
"""

from __future__ import annotations


class LmiServeError(Exception):
    """Base class. `message` is meant for the client (no Python internals in it)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as its class, message and attributes, whatever its constructor takes (an error crosses
        from the engine's process to the server's: engine/process/)."""
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))


def _rebuild(cls: type[LmiServeError], message: str, state: dict[str, object]) -> LmiServeError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


# ---- the request is wrong (client errors) ------------------------------------------------------------


class InvalidRequest(LmiServeError):
    """A payload or parameter value is invalid."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt and the tokens asked for, do not fit the model's context (each protocol
    words it its own way from the figures)."""

    def __init__(self, message: str, *, input_tokens: int, max_new_tokens: int, max_total: int, max_input: int):
        super().__init__(message)
        self.input_tokens = input_tokens
        self.max_new_tokens = max_new_tokens
        self.max_total = max_total
        self.max_input = max_input


class InvalidInput(InvalidRequest):
    """A tensor payload does not fit the model (names, datatypes, shapes, values)."""


class MalformedBody(InvalidRequest):
    """The body is not a document of the protocol at all (not JSON, not decodable)."""


class SchemaViolation(InvalidRequest):
    """The body is well-formed but does not match the protocol's schema (missing field, wrong type)."""


class TemplateError(InvalidRequest):
    """The model's chat template is missing or failed on these messages."""


class UnsupportedMediaType(InvalidRequest):
    """The request's Content-Type (or Content-Encoding) is not one this route reads."""


class NotAcceptable(InvalidRequest):
    """No media type in the request's Accept header can be produced."""


class PayloadTooLarge(InvalidRequest):
    """The body is larger than the configured limit."""


class HeadersTooLarge(InvalidRequest):
    """The request line and headers are larger than the configured limit."""


class ModelRequired(InvalidRequest):
    """A request without a model name while the server cannot pick a default model."""


class Unauthorized(LmiServeError):
    """The API key is missing or wrong."""


class Forbidden(LmiServeError):
    """The request is understood and authorized but refused by policy (e.g. a model path outside the
    allowed roots)."""


class NotFound(LmiServeError):
    """The addressed resource (a path, a model version, a label) does not exist."""


class ModelNotFound(NotFound):
    """No model of that name is served."""


class AdapterNotFound(NotFound):
    """A request names a LoRA adapter that is not served."""


class NoTextModel(ModelNotFound):
    """A text-generation route on a server that serves no LLM (only embedding or tensor models)."""


class Conflict(LmiServeError):
    """The request conflicts with the server's state (e.g. a model name already registered)."""


class Unsupported(LmiServeError):
    """The request asks for something valid that this server does not implement."""


# ---- the server cannot serve it now ------------------------------------------------------------------


class ModelNotReady(LmiServeError):
    """The model is loading, or failed to load."""


class ShuttingDown(ModelNotReady):
    """The server is stopping (draining after SIGTERM): it takes no new work, and work still open at
    the end of the drain is ended. Every protocol answers it like ModelNotReady (503)."""

    def __init__(self, message: str = "The server is shutting down"):
        super().__init__(message)


class Overloaded(LmiServeError):
    """No room for the request: the job queue is full or every admission slot is taken."""


class QueueTimeout(LmiServeError):
    """The request waited longer than predict_timeout for a free slot in the running batch."""


# ---- the server failed -------------------------------------------------------------------------------


class GenerationFailed(LmiServeError):
    """The model failed on a request that passed validation."""


class IncompleteGeneration(GenerationFailed):
    """The event stream ended before every sequence had finished."""


class InternalError(LmiServeError):
    """A server-side failure that is not the model's (an unencodable output, a load that failed)."""


EXCERPT_LIMIT = 100  # most characters of a request an error message quotes


def excerpt(text: str, limit: int = EXCERPT_LIMIT) -> str:
    """`text` as an error message may quote it: control and other unprintable characters escaped
    (``\\n``, ``\\x00``), at most `limit` characters, then ``...`` when it was longer."""
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: limit + 1])
    return escaped if len(text) <= limit and len(escaped) <= limit else escaped[:limit] + "..."
