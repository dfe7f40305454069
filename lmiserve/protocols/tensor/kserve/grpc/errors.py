"""The Open Inference Protocol's errors over gRPC: a status code and the REST message (the same words
as `/v2`'s `{"error": msg}`).

Codes: bad input INVALID_ARGUMENT; an unknown model, version or adapter NOT_FOUND; a model loading or a
server draining UNAVAILABLE (also a queue timeout: try again); a missing or wrong API key
UNAUTHENTICATED; a full queue or a message over `max_request_size` RESOURCE_EXHAUSTED (grpc refuses an
oversize message itself, with that code); a feature not implemented UNIMPLEMENTED; a failure inside the
model or the server INTERNAL. A request of a `ModelStreamInfer` stream gets its error as the stream's
`error_message` instead (Triton's way: the stream stays open); the code is then only in the words.
"""

from __future__ import annotations

import grpc

from lmiserve.core.errors import (
    Conflict,
    Forbidden,
    GenerationFailed,
    HeadersTooLarge,
    InternalError,
    InvalidRequest,
    LmiServeError,
    ModelNotReady,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QueueTimeout,
    Unauthorized,
    Unsupported,
)
from lmiserve.server.errors import lookup

PROTOCOL = "kserve-grpc"  # the protocol's name in the access log and the traces

CODES: dict[type[LmiServeError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    HeadersTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Conflict: grpc.StatusCode.ALREADY_EXISTS,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    ModelNotReady: grpc.StatusCode.UNAVAILABLE,  # ShuttingDown too
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QueueTimeout: grpc.StatusCode.UNAVAILABLE,
    GenerationFailed: grpc.StatusCode.INTERNAL,
    InternalError: grpc.StatusCode.INTERNAL,
}


def code_of(exc: LmiServeError) -> grpc.StatusCode:
    """The status code of a neutral error (INTERNAL for a class the table does not know)."""
    return lookup(exc, CODES, grpc.StatusCode.INTERNAL)
