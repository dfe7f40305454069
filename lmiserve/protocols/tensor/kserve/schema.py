"""KServe V2 / Open Inference Protocol bodies as pydantic models, for the API document
(`lmiserve.server.openapi`). `parse.py` decodes and encodes the bytes with the protocol's own checks;
these describe them, and the schemathesis test checks that they agree."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

DATATYPES = "BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BF16 or BYTES"


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str = Field(description=DATATYPES)
    parameters: dict[str, Any] | None = None
    data: Any = Field(None, description="The elements, row-major (flat or nested); absent with binary_data_size")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class V2InferRequest(BaseModel):
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hello"]}]}]
        },
    )

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None  # absent when sent as binary data


class V2InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


class IndexRequest(BaseModel):
    ready: bool | None = Field(None, description="true: only the models that are ready")


class IndexEntry(BaseModel):
    name: str
    version: str
    state: str  # READY, LOADING or UNAVAILABLE
    reason: str


class V2GenerateRequest(BaseModel):
    """Triton's generate extension; other top-level keys join `parameters`: LMI's parameter names, or
    the TensorRT-LLM / vLLM backends' (max_tokens, random_seed, stop_words, ignore_eos, min_length,
    min_tokens, exclude_input_in_output); one /generate cannot honour (bad_words, end_id, beam_width > 1,
    return_log_probs: true, ...) or does not know is a 400."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"examples": [{"text_input": "Hello", "parameters": {"max_new_tokens": 8}}]}
    )

    id: str | None = None
    text_input: str
    parameters: dict[str, Any] | None = None


class V2GenerateResponse(BaseModel):
    id: str | None = None
    model_name: str
    model_version: str
    text_output: str
