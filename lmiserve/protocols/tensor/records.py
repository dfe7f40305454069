"""Records (one JSON value or CSV row per instance) <-> a model's tensors, shared by SageMaker and Vertex.

A record is the instance for a single-input model (a string for text models, a number list for numeric
ones), or an object naming the inputs. For a single-input model an object with one key, the input's
name or a conventional record key (`RECORD_KEYS`: SageMaker's `{"features": [...]}`, `{"prompt": "..."}`),
is its value, so records may mix forms; any other key is an input the model does not declare (400). A model with
optional inputs beside one required one (a vision LLM's `image`) takes `{"prompt": ..., "image": ...}`. Predictions are
per record: the row of the one output, or an object of every output's row; NaN and infinities -> null.
"""

from __future__ import annotations

import math

import numpy as np

from lmiserve.core.errors import InternalError, InvalidInput
from lmiserve.core.tensor_io import check_names, conform
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor.codecs import tftensor

# Keys a one-key record may use for a single-input model, whatever the input's name: SageMaker's built-in
# algorithms' `features`, and the usual names of a text field.
RECORD_KEYS = ("features", "prompt", "text", "inputs")


def to_request(records: list, signature: ModelSignature, model: str, parameters: dict | None = None) -> TensorRequest:
    if not records:
        raise InvalidInput("no instances in the request")
    decoded = signature
    if len(signature.inputs) == 1:
        records = [_unwrap(r, signature, model) for r in records]
    elif len(signature.required) == 1:
        records, decoded = _with_optional(records, signature, model)
    arrays = tftensor.decode_instances(records, decoded)
    return TensorRequest(inputs=conform(arrays, signature, model), parameters=dict(parameters or {}))


def _with_optional(records: list, signature: ModelSignature, model: str) -> tuple[list, ModelSignature]:
    """Records of a model with one required input and optional ones (a vision LLM's `image`): each
    record the required input's value as a one-input model's record gives it, or an object of it (under
    its name or a `RECORD_KEYS` key) and optional inputs; every record gives the same optional inputs.
    The records as objects, and the signature of the inputs they give."""
    (required,) = signature.required
    optional = {t.name for t in signature.inputs if t.optional}
    out: list[dict] = []
    for record in records:
        extra: dict = {}
        if isinstance(record, dict) and not tftensor.is_b64(record) and optional & set(record):
            extra = {k: v for k, v in record.items() if k in optional}
            rest = {k: v for k, v in record.items() if k not in optional}
            if len(rest) != 1:
                names = ", ".join(sorted(rest)) or "none"
                raise InvalidInput(f"an instance must give one input for '{required.name}' (given: {names})")
            record = rest
        out.append({required.name: _unwrap(record, ModelSignature((required,), signature.outputs), model), **extra})
    given = set(out[0]) - {required.name}
    if any(set(record) - {required.name} != given for record in out):
        raise InvalidInput(
            f"every instance must give the same inputs ({', '.join(sorted(given)) or 'none'} beside the text)"
        )
    inputs = tuple(t for t in signature.inputs if t.name == required.name or t.name in given)
    return out, ModelSignature(inputs, signature.outputs)


def _unwrap(record: object, signature: ModelSignature, model: str) -> object:
    if isinstance(record, dict) and not tftensor.is_b64(record) and len(record) == 1:
        ((key, value),) = record.items()
        if key not in RECORD_KEYS:
            check_names([key], signature, model)
        return value
    if isinstance(record, dict) and not tftensor.is_b64(record) and any(k in RECORD_KEYS for k in record):
        # a record's text beside an input the model lacks (a text LLM's `image`): name that input
        unexpected = [k for k in record if k not in RECORD_KEYS and signature.input(k) is None]
        if unexpected:
            check_names(unexpected, signature, model)
    return record


def predictions(outputs: dict[str, np.ndarray], count: int) -> list:
    """One prediction per record (the n-th output row answers the n-th record)."""
    rows = {}
    for name, array in outputs.items():
        array = np.asarray(array)
        if array.ndim < 1 or array.shape[0] != count:
            raise InternalError(f"output '{name}' has {array.shape[0] if array.ndim else 0} rows for {count} records")
        rows[name] = [plain(v) for v in (array.tolist() if array.dtype != object else list(array))]
    if len(rows) == 1:
        return next(iter(rows.values()))
    return [{name: values[i] for name, values in rows.items()} for i in range(count)]


def as_objects(outputs: dict[str, np.ndarray], count: int) -> list[dict]:
    """One object of every output per record (JSON Lines rows)."""
    preds = predictions(outputs, count)
    if len(outputs) == 1:
        name = next(iter(outputs))
        return [{name: p} for p in preds]
    return preds


def plain(value: object) -> object:
    """JSON-safe Python value: bytes -> str, NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
