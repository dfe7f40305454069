"""TRANSITIONAL: what the not yet migrated SageMaker routes (protocols/tensor/sagemaker/) still import.
Nothing else may use it; delete this module once the SageMaker routes raise neutral errors and are
answered by a renderer.
"""

from __future__ import annotations

from lmiserve.core.errors import LmiServeError


class TensorError(LmiServeError):
    """TRANSITIONAL: an error carrying its own status (SageMaker's parse and routes only)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def protocol_status(exc: LmiServeError) -> int:
    """TRANSITIONAL: the tensor protocols' status of `exc` (the renderer's, or a TensorError's own)."""
    from lmiserve.protocols.tensor.errors import RENDERER

    if isinstance(exc, TensorError):
        return exc.status
    return RENDERER.status(exc)
