"""V2 datatypes <-> numpy: datatype names, nested or flat `data` lists, shape checks.

BYTES tensors are object arrays of `bytes` (JSON strings are UTF-8 encoded on the way in and decoded,
best effort, on the way out). FP16 is accepted and returned as JSON numbers (as MLServer does; Triton
and KServe refuse FP16 over JSON and require the binary extension). NaN and infinities leave as `null`
in JSON (as MLServer's REST layer renders them); `null` in an FP input becomes NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lmiserve.core import tensors
from lmiserve.core.errors import InternalError, InvalidInput
from lmiserve.core.tensor_io import fit_shape
from lmiserve.core.tensors import NUMPY_DTYPES

__all__ = ["DTYPES", "MAX_NESTING", "check_shape", "datatype_of", "fit_shape", "json_data", "numpy_dtype", "to_array"]

DTYPES = NUMPY_DTYPES
MAX_NESTING = 64  # nested `data` deeper than this is refused (Triton: HTTP_MAX_JSON_NESTING_DEPTH)


def numpy_dtype(datatype: str, name: str) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in DTYPES:
        raise InvalidInput(f"invalid datatype for input {name}")
    return DTYPES[datatype]


def datatype_of(array: np.ndarray) -> str:
    """The V2 datatype of an output array; str/bytes/object arrays are BYTES."""
    datatype = tensors.datatype_of(array)
    if datatype is None:
        raise InternalError(f"unsupported output dtype {array.dtype}")
    return datatype


def check_shape(shape: object, name: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidInput(f"invalid shape for input '{name}': expected a list of non-negative integers, got {shape!r}")
    return tuple(shape)


def flatten(data: object, name: str) -> list:
    """Row-major flat list of nested `data` (a scalar is one element); refuses nesting beyond MAX_NESTING."""
    if not isinstance(data, list):
        return [data]
    flat: list = []
    stack: list[tuple[list, int]] = [(data, 0)]
    while stack:
        items, index = stack.pop()
        while index < len(items):
            item = items[index]
            index += 1
            if isinstance(item, list):
                if len(stack) + 2 > MAX_NESTING:
                    raise InvalidInput(
                        f"JSON nesting depth exceeds maximum allowed limit ({MAX_NESTING}) in input '{name}'"
                    )
                stack.append((items, index))
                items, index = item, 0
            else:
                flat.append(item)
    return flat


def to_array(data: object, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
    """Check and convert one JSON tensor: element types, element count against `shape`."""
    dtype = numpy_dtype(datatype, name)
    flat = flatten(data, name)
    expected = math.prod(shape)
    if len(flat) != expected:
        raise InvalidInput(
            f"shape does not match data for input '{name}': "
            f"shape {list(shape)} needs {expected} elements, got {len(flat)}"
        )
    values = [_element(v, datatype, name) for v in flat]
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    else:
        _check_range(values, dtype, datatype, name)
        array = np.array(values, dtype=dtype)
    return array.reshape(shape)


def _element(value: object, datatype: str, name: str) -> object:
    if datatype == "BYTES":
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, bytes):
            return value
        raise InvalidInput(
            f"unable to parse 'data' of input '{name}': expected a string for BYTES, got {_json_type(value)}"
        )
    if datatype == "BOOL":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise InvalidInput(
            f"unable to parse 'data' of input '{name}': expected true or false for BOOL, got {_json_type(value)}"
        )
    if datatype.startswith("FP"):
        if value is None:
            return math.nan
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise InvalidInput(
            f"unable to parse 'data' of input '{name}': expected a number for {datatype}, got {_json_type(value)}"
        )
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidInput(
        f"unable to parse 'data' of input '{name}': expected an integer for {datatype}, got {_json_type(value)}"
    )


def _check_range(values: list, dtype: np.dtype, datatype: str, name: str) -> None:
    if dtype.kind not in "iu" or not values:
        return
    info = np.iinfo(dtype)
    low, high = min(values), max(values)
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise InvalidInput(f"unable to parse 'data' of input '{name}': {bad} is out of range for {datatype}")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def json_data(array: np.ndarray) -> list:
    """Flat JSON list of an array: NaN/inf -> null, BYTES -> strings (UTF-8, best effort)."""
    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind in "OSU":
        return [_text(v) for v in flat.tolist()]
    if flat.dtype.kind == "f":
        return [v if math.isfinite(v) else None for v in flat.astype(np.float64).tolist()]
    return flat.tolist()


def _text(value: object) -> object:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value
