"""Vertex AI's prediction bodies as pydantic models, for the API document (`lmiserve.server.openapi`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class VertexPredictRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"instances": ["Hello"]}]})

    instances: list[Any] = Field(min_length=1, description="One element per record")
    parameters: dict[str, Any] | None = None


class VertexPredictResponse(BaseModel):
    predictions: list[Any]
    deployedModelId: str  # Vertex's wire name
