"""Vertex AI custom-container predict: `{"instances": [...], "parameters": {...}}` ->
`{"predictions": [...], "deployedModelId": ...}`, one prediction per instance in order.

Instances are records (protocols/tensor/records.py); `parameters` go to the model (LLM generation
parameters). For an LLM an instance is a prompt string or an object with one text field
(`{"prompt": ...}`); its prediction is the generated text.
"""

from __future__ import annotations

import json

from lmiserve.core.errors import SchemaViolation
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor import records as tensor_records
from lmiserve.protocols.tensor.codecs.jsondoc import load_object


def parse(body: bytes, signature: ModelSignature, model: str) -> tuple[TensorRequest, int]:
    doc = load_object(
        body,
        failed="JSON deserialization failed for the request data",
        not_object='the request must be a JSON object {"instances": [...], "parameters": {...}}',
    )
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise SchemaViolation("'instances' must be a non-empty list")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise SchemaViolation("'parameters' must be a JSON object")
    return tensor_records.to_request(instances, signature, model, parameters), len(instances)


def response(outputs: dict, count: int, deployed_model_id: str) -> bytes:
    body = {"predictions": tensor_records.predictions(outputs, count), "deployedModelId": deployed_model_id}
    return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
