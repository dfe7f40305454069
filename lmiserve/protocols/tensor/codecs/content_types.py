"""MLServer content types over V2 tensors: `np`, `str`, `base64`, `datetime` (inputs), `pd` (requests),
`pd_json` (BYTES columns of a `pd` request or response).

Decoding gives the arrays a model takes (BYTES stay object arrays of `bytes`); encoding describes the
model's arrays the way MLServer's request codecs expect to decode them: numeric outputs `np`, text
outputs `str`, a `pd` request answered with one `[N, 1]` column per output (wider outputs as `pd_json`
rows). Unknown content types are left undecoded, as MLServer does.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from datetime import datetime

import numpy as np

from lmiserve.core import jsondoc
from lmiserve.core.errors import InvalidInput
from lmiserve.protocols.tensor.codecs.datatypes import to_array

INPUT_TYPES = ("np", "str", "base64", "datetime", "pd_json")
REQUEST_TYPES = ("np", "str", "pd")


def codec_error(message: str) -> InvalidInput:
    return InvalidInput(f"There was an error encoding / decoding the payload: {message}")


def decode_json_input(
    name: str, datatype: str, shape: tuple[int, ...], data: object, content_type: str | None
) -> np.ndarray:
    """One JSON input to an array, applying its content type."""
    if content_type == "str":
        return _object_array([_as_bytes(v, name) for v in _listify(data)])
    if content_type == "base64":
        return _object_array([_b64(v, name) for v in _listify(data)])
    if content_type == "datetime":
        return _object_array([_iso(v, name) for v in _listify(data)])
    if content_type == "pd_json":
        return _pd_json(_listify(data), name)
    return to_array(data, datatype, shape, name)


def decode_bytes_input(array: np.ndarray, content_type: str | None, name: str) -> np.ndarray:
    """Content types on a BYTES tensor that came in binary."""
    if content_type == "base64":
        return _object_array([_b64(v, name) for v in array.reshape(-1).tolist()])
    if content_type == "datetime":
        return _object_array([_iso(v, name) for v in array.reshape(-1).tolist()])
    if content_type == "pd_json":
        return _pd_json(array.reshape(-1).tolist(), name)
    return array


def _listify(data: object) -> list:
    return data if isinstance(data, list) else [data]


def _object_array(values: list) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _as_bytes(value: object, name: str) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise codec_error(f"input '{name}' with content type 'str' holds a {type(value).__name__}, not a string")


def _b64(value: object, name: str) -> bytes:
    raw = value if isinstance(value, bytes) else str(value).encode("ascii", errors="replace")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return raw  # MLServer passes elements that are not base64 through unchanged


def _iso(value: object, name: str) -> bytes:
    text = value.decode("ascii", errors="replace") if isinstance(value, bytes) else value
    if not isinstance(text, str):
        raise codec_error(
            f"input '{name}' with content type 'datetime' holds a {type(value).__name__}, not an ISO-8601 string"
        )
    try:
        return datetime.fromisoformat(text).isoformat().encode("ascii")
    except ValueError as exc:
        raise codec_error(f"input '{name}': {exc}") from None


def _pd_json(values: list, name: str) -> np.ndarray:
    try:
        rows = [jsondoc.loads(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise codec_error(f"input '{name}' with content type 'pd_json': {exc}") from None
    try:
        array = np.array(rows)
    except ValueError:
        raise codec_error(f"input '{name}' with content type 'pd_json' holds rows of different lengths") from None
    if array.dtype.kind not in "biuf":
        raise codec_error(f"input '{name}' with content type 'pd_json' must hold numbers")
    return array


def columns_to_inputs(columns: dict[str, np.ndarray], input_names: list[str]) -> dict[str, np.ndarray]:
    """A `pd` request (one column per V2 input) to the model's inputs.

    Columns named like the model's inputs feed those inputs; otherwise a single-input model gets the
    only column, or the numeric columns side by side as an `[N, columns]` matrix (column order kept).
    """
    flat = {
        name: (col.reshape(col.shape[0], -1) if col.ndim > 1 and col.shape[-1] == 1 else col)
        for name, col in columns.items()
    }
    flat = {name: (col[:, 0] if col.ndim == 2 and col.shape[1] == 1 else col) for name, col in flat.items()}
    if all(name in flat for name in input_names):
        return {name: flat[name] for name in input_names}
    if len(input_names) == 1:
        if len(flat) == 1:
            return {input_names[0]: next(iter(flat.values()))}
        cols = list(flat.values())
        lengths = {len(c) for c in cols}
        if len(lengths) != 1:
            raise codec_error("the columns of a 'pd' request must have the same length")
        if any(c.dtype.kind not in "biuf" or c.ndim != 1 for c in cols):
            raise codec_error(
                f"the columns {', '.join(flat)} of a 'pd' request can only be combined when they are numeric"
            )
        return {input_names[0]: np.stack(cols, axis=1)}
    missing = [n for n in input_names if n not in flat]
    raise codec_error(f"the 'pd' request has no column for the model input '{missing[0]}'")


def encode_output(array: np.ndarray, content_type: str, name: str) -> tuple[np.ndarray, str]:
    """An output in the content type its request asked for: `base64` (BYTES, each element encoded),
    `str` / `datetime` (BYTES as text), `np` (as is)."""
    if content_type == "np":
        return array, "np"
    if content_type not in ("str", "base64", "datetime"):
        raise codec_error(
            f"unsupported content type '{content_type}' for output '{name}' (np, str, base64 or datetime)"
        )
    if array.dtype.kind not in "OSU":
        raise codec_error(f"output '{name}' holds {array.dtype} numbers: content type '{content_type}' needs BYTES")
    values = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in array.reshape(-1).tolist()]
    if content_type == "base64":
        values = [base64.b64encode(v) for v in values]
    return _object_array(values).reshape(array.shape), content_type


def output_content_type(array: np.ndarray) -> str:
    return "str" if array.dtype.kind in "OSU" else "np"


def pd_column(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """An output as a DataFrame column: `[N, 1]` as is; wider rows as compact JSON text (`pd_json`)."""
    if array.ndim <= 1 or (array.ndim == 2 and array.shape[1] == 1):
        column = array.reshape(-1, 1) if array.ndim else array.reshape(1, 1)
        return column, ("str" if column.dtype.kind in "OSU" else None)
    rows = [json.dumps(_jsonable(row.tolist()), separators=(",", ":"), allow_nan=False) for row in array]
    return _object_array([r.encode("utf-8") for r in rows]).reshape(-1, 1), "pd_json"


def _jsonable(value):
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value
