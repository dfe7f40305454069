"""gRPC messages <-> the documents of the REST implementation (kserve/parse.py), so both transports check
and word a request the same way.

A `ModelInferRequest` becomes REST's inference document and binary tail: each input's elements are either
its typed `contents` (the field of its datatype: `int_contents` for INT8..INT32, `fp32_contents` for FP32,
`bytes_contents` for BYTES, ...) as the input's ``data``, or its element of `raw_input_contents` (one per
input, all or none, in Triton's binary layout) as a binary segment (``binary_data_size``). Parameters
(`InferParameter`: bool, int64, uint64, double, string) become plain values.

Outputs go back as `raw_output_contents` (Triton's layout, as Triton answers) when the request sent raw
contents, asked for ``binary_data_output``, or an output has no typed field (FP16); else as typed
`contents`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lmiserve.core.errors import InvalidInput, SchemaViolation
from lmiserve.protocols.tensor.codecs import binary
from lmiserve.protocols.tensor.codecs.datatypes import DTYPES
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.grpc import oip_pb2 as pb

# The typed field of each datatype (FP16 has none: it travels raw).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_FIELDS = sorted(set(CONTENTS.values()))
_INT64_MAX = 2**63 - 1


# ---- parameters -------------------------------------------------------------------------------------
def value_of(parameter: Any, where: str) -> bool | int | float | str:
    """The value an `InferParameter` holds; SchemaViolation when it holds none."""
    which = parameter.WhichOneof("parameter_choice")
    if which is None:
        raise SchemaViolation(f"parameter '{where}' has no value")
    return getattr(parameter, which)


def values_of(parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value_of(parameter, key) for key, parameter in parameters.items()}


def set_parameter(target: Any, key: str, value: Any) -> None:
    """`target[key]` (a parameters map) = `value` in the oneof field of its type."""
    parameter = target[key]
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        if value > _INT64_MAX:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


# ---- a request --------------------------------------------------------------------------------------
def request_document(request: Any, model: str) -> tuple[dict[str, Any], bytes]:
    """REST's inference document and binary tail of a `ModelInferRequest` for `model`."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"expected {len(request.inputs)} elements in raw_input_contents (one per input) "
            f"but got {len(raw)} for model '{model}'"
        )
    inputs, segments = [], []
    for index, tensor in enumerate(request.inputs):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        params = values_of(tensor.parameters)
        params.pop("binary_data_size", None)  # REST's; the contents say how the data came here
        if raw:
            if _has_contents(tensor):
                raise InvalidInput(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' "
                    f"for model '{model}'"
                )
            params["binary_data_size"] = len(raw[index])
            segments.append(raw[index])
        else:
            entry["data"] = _typed(tensor)
        entry["parameters"] = params
        inputs.append(entry)
    doc: dict[str, Any] = {"inputs": inputs, "parameters": values_of(request.parameters)}
    if request.id:
        doc["id"] = request.id
    if request.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": values_of(o.parameters)} for o in request.outputs]
    return doc, b"".join(segments)


def _has_contents(tensor: Any) -> bool:
    return tensor.HasField("contents") and any(len(getattr(tensor.contents, f)) for f in _FIELDS)


def _typed(tensor: Any) -> list[Any]:
    """The input's elements from its typed contents (InvalidInput for elements in another field)."""
    field = CONTENTS.get(tensor.datatype)
    if field is None:
        if tensor.datatype in DTYPES:  # FP16
            raise InvalidInput(
                f"input '{tensor.name}' is {tensor.datatype}, which has no typed contents: "
                "send its data in raw_input_contents"
            )
        return []  # parse_infer names the unknown datatype
    others = [f for f in _FIELDS if f != field and len(getattr(tensor.contents, f))]
    if others:
        raise InvalidInput(
            f"input '{tensor.name}' is {tensor.datatype}: its elements go in '{field}', not '{others[0]}'"
        )
    return list(getattr(tensor.contents, field))


# ---- a response -------------------------------------------------------------------------------------
def wants_raw(request: Any, plan: kserve.OutputPlan) -> bool:
    """Whether to answer with `raw_output_contents` (see the module docstring)."""
    return bool(request.raw_input_contents) or plan.binary_default or any(plan.binary.values())


def infer_response(
    model: str,
    outputs: dict[str, np.ndarray],
    plan: kserve.OutputPlan,
    raw: bool,
    parameters: Mapping[str, Any] | None = None,
) -> Any:
    """The `ModelInferResponse` of a model's outputs (see the module docstring); `parameters`: the
    response's own (e.g. Triton's ``triton_final_response``)."""
    described = kserve.described_outputs(outputs, plan)
    raw = raw or any(out.datatype not in CONTENTS for out in described)
    response = pb.ModelInferResponse(model_name=model, model_version=kserve.VERSION, id=plan.id or "")
    for key, value in {**kserve.response_parameters(described, plan), **(parameters or {})}.items():
        set_parameter(response.parameters, key, value)
    for out in described:
        tensor = response.outputs.add(name=out.name, datatype=out.datatype, shape=list(out.array.shape))
        for key, value in out.parameters.items():
            set_parameter(tensor.parameters, key, value)
        if raw:
            response.raw_output_contents.append(binary.encode_tensor(out.array))
        else:
            _fill(tensor.contents, out.datatype, out.array)
    return response


def _fill(contents: Any, datatype: str, array: np.ndarray) -> None:
    field = getattr(contents, CONTENTS[datatype])
    flat = np.asarray(array).reshape(-1)
    if datatype == "BYTES":
        field.extend(v if isinstance(v, bytes) else str(v).encode("utf-8") for v in flat.tolist())
    else:
        field.extend(flat.tolist())
