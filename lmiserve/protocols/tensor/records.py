"""Records (one JSON value or CSV row per instance) <-> a model's tensors, shared by SageMaker and Vertex.

A record is the instance for a single-input model (a string for text models, a number list for numeric
ones), or an object naming the inputs. For a single-input model an object with one key (the input's
name, SageMaker's `{"features": [...]}`, `{"prompt": "..."}`) is its value, so records may mix forms. Predictions are
per record: the row of the one output, or an object of every output's row; NaN and infinities -> null.
"""

from __future__ import annotations

import math

import numpy as np

from lmiserve.core.errors import InternalError, InvalidInput
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.protocols.tensor.codecs import tftensor
from lmiserve.protocols.tensor.codecs.datatypes import fit_shape


def to_request(records: list, signature: ModelSignature, model: str, parameters: dict | None = None) -> TensorRequest:
    if not records:
        raise InvalidInput("no instances in the request")
    names = {t.name for t in signature.inputs}
    if len(names) == 1:
        records = [_unwrap(r, names) for r in records]
    arrays = tftensor.decode_instances(records, signature)
    inputs = {t.name: fit_shape(arrays[t.name], t.shape, t.name, model) for t in signature.inputs}
    return TensorRequest(inputs=inputs, parameters=dict(parameters or {}))


def _unwrap(record: object, names: set[str]) -> object:
    if isinstance(record, dict) and not tftensor.is_b64(record) and len(record) == 1:
        return next(iter(record.values()))
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
