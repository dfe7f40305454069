"""The one error every codec raises: a message meant for the client and the HTTP status it deserves."""

from __future__ import annotations

from lmiserve.core.errors import LmiServeError


class TensorError(LmiServeError):
    """Bad tensor payload (400 unless the protocol says otherwise, e.g. 404, 415, 501)."""

    kind = "InvalidInput"

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
