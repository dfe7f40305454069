"""KServe V2 / Open Inference Protocol: inference request -> TensorRequest, model outputs -> response.

JSON and Triton's binary extension (any body with `Inference-Header-Content-Length`), MLServer content
types on inputs (`np`, `str`, `base64`, `datetime`, `pd_json`) and requests (`np`, `str`, `pd`).
Input datatypes must match the signature (as Triton demands), except that inputs carrying an MLServer
content type may be cast between numeric datatypes (MLServer hands models decoded numpy values).
A model with one input takes a single request input under any name (MLServer's request codecs call
it `input-1`). Requested outputs pick and order the outputs; `binary_data` / `binary_data_output`
choose binary output segments (default JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmiserve.core import jsondoc
from lmiserve.core.errors import InvalidInput, MalformedBody, SchemaViolation
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor.codecs import binary, content_types
from lmiserve.protocols.tensor.codecs.datatypes import (
    DTYPES,
    check_shape,
    datatype_of,
    fit_shape,
    json_data,
)
from lmiserve.protocols.tensor.codecs.jsondoc import load_object

VERSION = "1"
_RESERVED = frozenset({"binary_data_output", "headers"})


@dataclass
class OutputPlan:
    id: str | None = None
    names: list[str] | None = None
    binary: dict[str, bool] = field(default_factory=dict)
    content_types: dict[str, str] = field(default_factory=dict)  # requested outputs' `content_type`
    binary_default: bool = False
    request_content_type: str | None = None
    mlserver: bool = False  # content types in the request: describe outputs the MLServer way


def load_header(header: bytes) -> dict[str, Any]:
    return load_object(
        header,
        failed="failed to parse the request JSON",
        not_object="the inference request must be a JSON object",
    )


def index_ready_only(body: bytes) -> bool:
    """Whether a repository index request (`{"ready": true}`, or an empty body) asks for READY models only."""
    try:
        doc = jsondoc.loads(body or b"{}")
    except ValueError:
        raise MalformedBody("failed to parse the request JSON") from None
    return isinstance(doc, dict) and doc.get("ready") is True


def parse_infer(doc: dict, tail: bytes, model: str, signature: ModelSignature) -> tuple[TensorRequest, OutputPlan]:
    params = _params(doc.get("parameters"), "request")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise SchemaViolation("the inference request needs a non-empty 'inputs' list")
    request_ct = params.get("content_type") if isinstance(params.get("content_type"), str) else None
    reader = binary.BinaryReader(tail)
    arrays: dict[str, np.ndarray] = {}
    typed = {}
    for item in inputs:
        name, array, has_ct = _input(item, reader, model)
        if name in arrays:
            raise InvalidInput(f"input '{name}' is given more than once")
        arrays[name], typed[name] = array, has_ct
    reader.check_consumed()
    names = [t.name for t in signature.inputs]
    if request_ct == "pd":
        arrays = content_types.columns_to_inputs(arrays, names)
        typed = {n: True for n in arrays}
    elif len(names) == 1 and len(arrays) == 1 and names[0] not in arrays:
        ((given, array),) = arrays.items()
        arrays, typed = {names[0]: array}, {names[0]: typed[given] or request_ct is not None}
    model_inputs = _check_inputs(arrays, typed, signature, model)
    plan = _plan(doc, params, signature, model, request_ct)
    plan.mlserver = plan.mlserver or any(typed.values())
    parameters = {k: v for k, v in params.items() if k not in _RESERVED}
    return TensorRequest(inputs=model_inputs, parameters=parameters, outputs=plan.names), plan


def _params(value: object, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SchemaViolation(f"'parameters' of the {where} must be a JSON object")
    return value


def _input(item: object, reader: binary.BinaryReader, model: str) -> tuple[str, np.ndarray, bool]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise SchemaViolation("every input must be an object with a string 'name'")
    name = item["name"]
    datatype = item.get("datatype")
    if not isinstance(datatype, str) or datatype not in DTYPES:
        raise InvalidInput(f"invalid datatype for input {name}")
    shape = check_shape(item.get("shape"), name)
    params = _params(item.get("parameters"), f"input '{name}'")
    ct = params.get("content_type") if isinstance(params.get("content_type"), str) else None
    if "binary_data_size" in params:
        raw = reader.take(params["binary_data_size"], name)
        array = binary.decode_tensor(raw, datatype, shape, name)
        if datatype == "BYTES":
            array = content_types.decode_bytes_input(array, ct, name)
        return name, array, ct in content_types.INPUT_TYPES
    if "data" not in item:
        raise SchemaViolation(f"'data' field is missing for input '{name}' for model '{model}'")
    array = content_types.decode_json_input(name, datatype, shape, item["data"], ct)
    return name, array, ct in content_types.INPUT_TYPES


def _check_inputs(
    arrays: dict[str, np.ndarray], typed: dict[str, bool], signature: ModelSignature, model: str
) -> dict[str, np.ndarray]:
    for name in arrays:
        if signature.input(name) is None:
            raise InvalidInput(f"unexpected inference input '{name}' for model '{model}'")
    if len(arrays) != len(signature.inputs):
        raise InvalidInput(f"expected {len(signature.inputs)} inputs but got {len(arrays)} inputs for model '{model}'")
    out = {}
    for spec in signature.inputs:
        array = arrays[spec.name]
        got = datatype_of(array)
        if got != spec.datatype:
            numeric = got != "BYTES" and spec.datatype != "BYTES"
            if not (typed.get(spec.name) and numeric):
                raise InvalidInput(
                    f"inference input '{spec.name}' data-type is '{got}', but model '{model}' expects '{spec.datatype}'"
                )
            array = array.astype(DTYPES[spec.datatype])
        out[spec.name] = fit_shape(array, spec.shape, spec.name, model)
    return out


def _plan(doc: dict, params: dict, signature: ModelSignature, model: str, request_ct: str | None) -> OutputPlan:
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise SchemaViolation("'id' must be a string")
    plan = OutputPlan(
        id=request_id, binary_default=params.get("binary_data_output") is True, request_content_type=request_ct
    )
    plan.mlserver = request_ct in content_types.REQUEST_TYPES
    outputs = doc.get("outputs")
    if outputs is None:
        return plan
    if not isinstance(outputs, list):
        raise SchemaViolation("'outputs' must be a list of requested outputs")
    plan.names = []
    for item in outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise SchemaViolation("every requested output must be an object with a string 'name'")
        name = item["name"]
        if signature.output(name) is None:
            raise InvalidInput(f"unexpected inference output '{name}' for model '{model}'")
        out_params = _params(item.get("parameters"), f"output '{name}'")
        if "binary_data" in out_params:
            plan.binary[name] = out_params["binary_data"] is True
        if isinstance(out_params.get("content_type"), str):
            plan.content_types[name] = out_params["content_type"]
            plan.mlserver = True
        plan.names.append(name)
    return plan


def encode_response(outputs: dict[str, np.ndarray], plan: OutputPlan, model: str) -> tuple[bytes, dict[str, str], str]:
    """(body, extra headers, content type)."""
    names = plan.names if plan.names is not None else list(outputs)
    described, segments = [], []
    pandas = plan.request_content_type == "pd"
    for name in names:
        array = np.asarray(outputs[name])
        ct = None
        if name in plan.content_types:
            array, ct = content_types.encode_output(array, plan.content_types[name], name)
        elif pandas:
            array, ct = content_types.pd_column(array)
        elif plan.mlserver:
            ct = content_types.output_content_type(array)
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        params: dict[str, Any] = {"content_type": ct} if ct else {}
        if plan.binary.get(name, plan.binary_default):
            raw = binary.encode_tensor(array)
            params["binary_data_size"] = len(raw)
            segments.append(raw)
        else:
            entry["data"] = json_data(array)
        if params:
            entry["parameters"] = params
        described.append(entry)
    body: dict[str, Any] = {"model_name": model, "model_version": VERSION}
    if plan.id is not None:
        body["id"] = plan.id
    if plan.mlserver:
        only = described[0].get("parameters", {}).get("content_type") if len(described) == 1 else None
        body["parameters"] = {"content_type": "pd" if pandas else (plan.request_content_type or only or "np")}
    body["outputs"] = described
    header = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if not segments:
        return header, {}, "application/json"
    payload, headers = binary.compose(header, segments)
    return payload, headers, "application/octet-stream"


def metadata(model: str, kind: str, signature: ModelSignature) -> dict:
    def tensors(specs):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in specs]

    return {
        "name": model,
        "versions": [VERSION],
        "platform": f"lmiserve_{kind}",
        "inputs": tensors(signature.inputs),
        "outputs": tensors(signature.outputs),
    }
