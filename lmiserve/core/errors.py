"""Errors that carry their HTTP status and a kind; one handler renders them per protocol."""

from __future__ import annotations


class LmiServeError(Exception):
    """Base class: `status` is the HTTP status, `kind` a short machine-readable type name."""

    status: int = 500
    kind: str = "InternalServerException"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(LmiServeError):
    """The payload or a parameter value is invalid (LMI answers these with 424)."""

    status = 424
    kind = "validation"


class EngineOverloaded(LmiServeError):
    """The job queue is full."""

    status = 503
    kind = "WlmCapacityException"


class QueueTimeout(LmiServeError):
    """A request waited longer than predict_timeout for a free slot in the running batch."""

    status = 400
    kind = "TranslateException"


class ModelNotReady(LmiServeError):
    status = 503
    kind = "ServiceUnavailableException"


class ModelNotFound(LmiServeError):
    status = 404
    kind = "ModelNotFoundException"


class InferenceFailed(LmiServeError):
    """The model failed on a request that passed validation (LMI answers handler failures with 424)."""

    status = 424
    kind = "InferenceFailed"
