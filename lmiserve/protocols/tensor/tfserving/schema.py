"""TF Serving's REST bodies as pydantic models, for the API document (`lmiserve.server.openapi`).
`parse.py` decodes and encodes the bytes with TF Serving's own checks and messages; these describe
them, and the schemathesis test checks that they agree."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TfPredictRequest(BaseModel):
    """Row format (`instances`) or columnar format (`inputs`): exactly one of them."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"instances": ["Hello"]}]})

    signature_name: str | None = None
    instances: list[Any] | None = Field(None, description="One element per example (row format)")
    inputs: Any = Field(None, description="A tensor, or an object of named tensors (columnar format)")


class TfPredictResponse(BaseModel):
    predictions: Any = Field(None, description="Row format answer (to `instances`)")
    outputs: Any = Field(None, description="Columnar answer (to `inputs`)")


class TfExamplesRequest(BaseModel):
    signature_name: str | None = None
    examples: list[dict[str, Any]]
    context: dict[str, Any] | None = None


class TfClassifyResponse(BaseModel):
    results: list[list[list[str | float]]] = Field(description="Per example, its [label, score] pairs")


class TfRegressResponse(BaseModel):
    results: list[float]


class VersionStatus(BaseModel):
    version: str
    state: str  # AVAILABLE, LOADING or END
    status: dict[str, str]


class TfModelStatus(BaseModel):
    model_version_status: list[VersionStatus]


class TfModelMetadata(BaseModel):
    model_spec: dict[str, Any]
    metadata: dict[str, Any]
