"""KServe V2 / Open Inference Protocol: inference request -> TensorRequest, model outputs -> response.

JSON and Triton's binary extension (any body with `Inference-Header-Content-Length`), MLServer content
types on inputs (`np`, `str`, `base64`, `datetime`, `pd_json`) and requests (`np`, `str`, `pd`).
Inputs are checked against the model's signature as Triton does (`core.tensor_io.conform`, before
any data is decoded for the names): no undeclared input, every required one, the declared datatype
(inputs carrying an MLServer content type may be cast between numeric datatypes, as MLServer hands
models decoded numpy values) and a compatible shape. Only a request-level MLServer codec frees the
names: `np` / `str` with one input for a one-input model (MLServer's request codecs call it
`input-1`), `pd` (columns, see content_types.columns_to_inputs). Requested outputs pick and order the
outputs; `binary_data` / `binary_data_output` choose binary output segments (default JSON).

`parse_infer` takes a model-independent document: REST's JSON header and binary tail, or a gRPC
`ModelInferRequest` turned into one (kserve/grpc/convert.py), so both transports check and word
everything the same way. Its `settings` are the names of inputs that are not the model's tensors but
request settings given as tensors (an LLM's `max_tokens`, `temperature`, ... as TensorRT-LLM ensembles
take them): they are decoded like any input and handed back apart.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmiserve.core import jsondoc
from lmiserve.core.errors import InvalidInput, MalformedBody, SchemaViolation
from lmiserve.core.tensor_io import check_names, conform
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor.codecs import binary, content_types
from lmiserve.protocols.tensor.codecs.datatypes import DTYPES, check_shape, datatype_of, json_data
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


def parse_infer(
    doc: dict, tail: bytes, model: str, signature: ModelSignature, settings: Collection[str] = ()
) -> tuple[TensorRequest, OutputPlan, dict[str, np.ndarray]]:
    """The model's request, how to answer it, and the inputs named in `settings` that the model does not
    declare (request settings sent as tensors), decoded."""
    params = _params(doc.get("parameters"), "request")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise SchemaViolation("the inference request needs a non-empty 'inputs' list")
    request_ct = params.get("content_type") if isinstance(params.get("content_type"), str) else None
    every = _names(inputs)
    lifted = {n for n in every if n in settings and signature.input(n) is None}
    given = [n for n in every if n not in lifted]
    names = [t.name for t in signature.inputs]
    whole = request_ct in ("np", "str") and len(names) == 1 and len(given) == 1  # a request codec's one input
    if request_ct != "pd" and not whole:
        check_names(given, signature, model)
    reader = binary.BinaryReader(tail)  # every input in order, the lifted ones too: they own their segments
    arrays: dict[str, np.ndarray] = {}
    setting_tensors: dict[str, np.ndarray] = {}
    typed = {}
    for item in inputs:
        name, array, has_ct = _input(item, reader, model)
        if name in lifted:
            setting_tensors[name] = array
        else:
            arrays[name], typed[name] = array, has_ct
    reader.check_consumed(model)
    if request_ct == "pd":
        arrays = content_types.columns_to_inputs(arrays, names)
        typed = {n: True for n in arrays}
    elif whole:
        ((name, array),) = arrays.items()
        arrays, typed = {names[0]: array}, {names[0]: True}
    castable = {n for n, has_ct in typed.items() if has_ct}
    model_inputs = conform(arrays, signature, model, castable=castable)
    plan = _plan(doc, params, signature, model, request_ct)
    plan.mlserver = plan.mlserver or any(typed.values())
    parameters = {k: v for k, v in params.items() if k not in _RESERVED}
    return TensorRequest(inputs=model_inputs, parameters=parameters, outputs=plan.names), plan, setting_tensors


def _params(value: object, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SchemaViolation(f"'parameters' of the {where} must be a JSON object")
    return value


def _names(inputs: list) -> list[str]:
    """The inputs' names, each once; SchemaViolation for an input that is not an object with a name."""
    names: list[str] = []
    for item in inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise SchemaViolation("every input must be an object with a string 'name'")
        if item["name"] in names:
            raise InvalidInput(f"input '{item['name']}' is given more than once")
        names.append(item["name"])
    return names


def _input(item: dict, reader: binary.BinaryReader, model: str) -> tuple[str, np.ndarray, bool]:
    name = item["name"]
    datatype = item.get("datatype")
    if not isinstance(datatype, str) or datatype not in DTYPES:
        raise InvalidInput(f"invalid datatype for input {name}")
    shape = check_shape(item.get("shape"), name)
    params = _params(item.get("parameters"), f"input '{name}'")
    ct = params.get("content_type") if isinstance(params.get("content_type"), str) else None
    if "binary_data_size" in params:
        raw = reader.take(params["binary_data_size"], name, model)
        array = binary.decode_tensor(raw, datatype, shape, name, model)
        if datatype == "BYTES":
            array = content_types.decode_bytes_input(array, ct, name)
        return name, array, ct in content_types.INPUT_TYPES
    if "data" not in item:
        raise SchemaViolation(f"'data' field is missing for input '{name}' for model '{model}'")
    array = content_types.decode_json_input(name, datatype, shape, item["data"], ct)
    return name, array, ct in content_types.INPUT_TYPES


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


@dataclass
class Output:
    """One output tensor as the response describes it: the array to send (after any MLServer content
    type's encoding), its datatype and shape, and its parameters (`content_type`)."""

    name: str
    array: np.ndarray
    datatype: str
    parameters: dict[str, Any]


def described_outputs(outputs: dict[str, np.ndarray], plan: OutputPlan) -> list[Output]:
    """The outputs to answer, in order, as REST and gRPC describe them."""
    names = plan.names if plan.names is not None else list(outputs)
    pandas = plan.request_content_type == "pd"
    described = []
    for name in names:
        array = np.asarray(outputs[name])
        ct = None
        if name in plan.content_types:
            array, ct = content_types.encode_output(array, plan.content_types[name], name)
        elif pandas:
            array, ct = content_types.pd_column(array)
        elif plan.mlserver:
            ct = content_types.output_content_type(array)
        described.append(Output(name, array, datatype_of(array), {"content_type": ct} if ct else {}))
    return described


def response_parameters(described: list[Output], plan: OutputPlan) -> dict[str, Any]:
    """The response's own parameters: MLServer's request content type, when the request used one."""
    if not plan.mlserver:
        return {}
    only = described[0].parameters.get("content_type") if len(described) == 1 else None
    pandas = plan.request_content_type == "pd"
    return {"content_type": "pd" if pandas else (plan.request_content_type or only or "np")}


def encode_response(outputs: dict[str, np.ndarray], plan: OutputPlan, model: str) -> tuple[bytes, dict[str, str], str]:
    """(body, extra headers, content type)."""
    described, segments = [], []
    outs = described_outputs(outputs, plan)
    for out in outs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        params = dict(out.parameters)
        if plan.binary.get(out.name, plan.binary_default):
            raw = binary.encode_tensor(out.array)
            params["binary_data_size"] = len(raw)
            segments.append(raw)
        else:
            entry["data"] = json_data(out.array)
        if params:
            entry["parameters"] = params
        described.append(entry)
    body: dict[str, Any] = {"model_name": model, "model_version": VERSION}
    if plan.id is not None:
        body["id"] = plan.id
    if plan.mlserver:
        body["parameters"] = response_parameters(outs, plan)
    body["outputs"] = described
    header = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if not segments:
        return header, {}, "application/json"
    payload, headers = binary.compose(header, segments)
    return payload, headers, "application/octet-stream"


def metadata(model: str, kind: str, signature: ModelSignature) -> dict:
    def tensors(specs):
        return [
            {
                "name": t.name,
                "datatype": t.datatype,
                "shape": list(t.shape),
                **({"optional": True} if t.optional else {}),
            }
            for t in specs
        ]

    return {
        "name": model,
        "versions": [VERSION],
        "platform": f"lmiserve_{kind}",
        "inputs": tensors(signature.inputs),
        "outputs": tensors(signature.outputs),
    }
