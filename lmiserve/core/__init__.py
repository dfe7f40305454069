"""Protocol-free data shared by every layer: requests, parameters, events and errors."""

from lmiserve.core.errors import (
    Overloaded,
    InvalidRequest,
    LmiServeError,
    ModelNotFound,
    ModelNotReady,
    QueueTimeout,
)
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import GenerationRequest, SamplingParams

__all__ = [
    "Overloaded",
    "Finish",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequest",
    "LmiServeError",
    "ModelNotFound",
    "ModelNotReady",
    "QueueTimeout",
    "SamplingParams",
    "StepEvent",
    "Token",
]
