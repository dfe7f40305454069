"""The one error every codec raises: a message meant for the client and the HTTP status it deserves."""

from __future__ import annotations

from lmiserve.core.errors import LmiServeError


class TensorError(LmiServeError):
    """Bad tensor payload (400 unless the protocol says otherwise, e.g. 404, 415, 501)."""

    kind = "InvalidInput"

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.tensor_status = status  # TRANSITIONAL: read by protocols/tensor/errors.py until TensorError is gone


def protocol_status(exc: LmiServeError) -> int:
    """The status a tensor protocol answers a core error with (LMI's 424 is not theirs).

    Invalid input 400; unknown model 404; not ready / overloaded 503; a failure inside the model 500.
    """
    if isinstance(exc, TensorError):
        return exc.status
    kind = type(exc).__name__
    if kind == "InvalidRequest":
        return 400
    if kind == "GenerationFailed":
        return 500
    if kind == "QueueTimeout":
        return 503
    return exc.status
