"""SageMaker's answers as pydantic models, for the API document (`lmiserve.server.openapi`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Predictions(BaseModel):
    """A JSON answer: one prediction per record."""

    predictions: list[Any]


class ExecutionParameters(BaseModel):
    MaxConcurrentTransforms: int
    BatchStrategy: str
    MaxPayloadInMB: int
