"""Protocol-free data shared by every layer: requests, parameters, events and errors."""

from lmiserve.core.errors import (
    InvalidRequest,
    LmiServeError,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    QueueTimeout,
)
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import GenerationRequest, SamplingParams

__all__ = [
    "Finish",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequest",
    "LmiServeError",
    "ModelNotFound",
    "ModelNotReady",
    "Overloaded",
    "QueueTimeout",
    "SamplingParams",
    "StepEvent",
    "Token",
]
