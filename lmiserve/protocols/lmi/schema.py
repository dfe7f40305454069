"""LMI's requests and answers as pydantic models, for the API document (`lmiserve.server.openapi`).

The inference routes decode their bodies with `parse.py` (LMI's own checks and messages) and write
them with the formatters; these models describe those bytes, and the schemathesis test checks that
they agree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lmiserve.core.parameters import GenerationParameters


class LmiRequest(BaseModel):
    """A text-generation request (a one-shot model takes `inputs` of its kind instead)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"examples": [{"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 8}}]},
    )

    inputs: str | list[str] = Field(description="The prompt (a list of prompts under rolling_batch=disable)")
    parameters: GenerationParameters | None = None
    stream: bool = False


class LmiAnswer(BaseModel):
    """The `json` formatter's answer (the `tgi` formatter and a static batch answer a list of them)."""

    generated_text: str
    details: dict[str, Any] | None = None


class LmiStreamRecord(BaseModel):
    """One line (`jsonlines`) or event (`sse`) per token; the last also has `generated_text` (and
    `details`); a failure after the start is a last ``{"error", "code"}`` record. A static batch's
    stream sends ``{"outputs": [...]}`` lines instead."""

    model_config = ConfigDict(extra="allow")

    token: dict[str, Any] | None = None
    generated_text: str | None = None
    details: dict[str, Any] | None = None


class ModelHealth(BaseModel):
    status: str  # Healthy or Unhealthy


Ping = dict[str, ModelHealth]  # model name -> health


class ModelSummary(BaseModel):
    modelName: str  # LMI's wire names (camelCase)
    modelUrl: str
    status: str


class ModelPage(BaseModel):
    nextPageToken: str | None = None  # present when more models follow
    models: list[ModelSummary]


class Worker(BaseModel):
    id: int
    startTime: str
    status: str


class WorkerGroup(BaseModel):
    device: dict[str, Any]
    minWorkers: int
    maxWorkers: int
    workers: list[Worker]


class ModelDescription(BaseModel):
    modelName: str
    modelUrl: str
    batchSize: int
    maxBatchDelayMillis: int
    maxIdleSeconds: int
    queueSize: int
    requestInQueue: int
    status: str
    loadedAtStartup: bool
    workerGroups: list[WorkerGroup]


class Workflow(BaseModel):
    workflowName: str
    version: str
    models: list[ModelDescription]


class StatusMessage(BaseModel):
    status: str


class Registration(BaseModel):
    """POST /models options, as query parameters or as this JSON body (the query wins)."""

    url: str | None = Field(None, description="A model directory or file under model_store / allowed_model_paths")
    model_name: str | None = None
    synchronous: bool | str | None = None
    batch_size: int | str | None = None
    max_batch_delay: int | str | None = None
    job_queue_size: int | str | None = None
    device: str | None = None
    dtype: str | None = None
    model_kind: str | None = None


class AdapterSummary(BaseModel):
    name: str
    src: str = Field(description="The adapter's folder")
    pin: bool = Field(description="Pinned: never dropped from memory")
    loaded: bool = Field(description="Its weights are in memory (else they load on its next request)")


class AdapterPage(BaseModel):
    nextPageToken: str | None = None  # present when more adapters follow
    adapters: list[AdapterSummary]


class AdapterDescription(AdapterSummary):
    rank: int | None = Field(None, description="Its highest LoRA rank (when loaded)")
    targetModules: list[str] | None = Field(None, description="The linears it adapts (when loaded)")
    sizeBytes: int | None = Field(None, description="Memory its weights take (when loaded)")
    requests: int = Field(description="Requests served since it was registered")
    running: int = Field(description="Requests running on it now")
    registeredAt: str
    error: str | None = Field(None, description="Why its last load failed")


class AdapterRegistration(BaseModel):
    """POST .../adapters options, as query parameters or as this JSON body (the query wins)."""

    name: str | None = Field(None, description="The adapter's name (requests select it by this name)")
    src: str | None = Field(None, description="A PEFT LoRA adapter folder under model_store / allowed_model_paths")
    preload: bool | str | None = Field(None, description="Load its weights now (default true)")
    pin: bool | str | None = Field(None, description="Keep it in memory (default false)")


class AdapterUpdate(BaseModel):
    """POST .../adapters/{name}/update options, as query parameters or as this JSON body."""

    src: str | None = Field(None, description="A new folder (its weights are read again)")
    pin: bool | str | None = None
    preload: bool | str | None = None
