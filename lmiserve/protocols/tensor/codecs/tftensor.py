"""TF Serving JSON tensors: `instances` (row) and `inputs` (columnar) to arrays, arrays to
`predictions` / `outputs`, with TF Serving's messages (every error is its INVALID_ARGUMENT, 400, except
a JSON value for a dtype TF Serving cannot convert from JSON: UNIMPLEMENTED, 501).

Signatures are `core.tensors.ModelSignature`s; V2 datatypes map to TF dtypes (FP32 = DT_FLOAT, ...).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from lmiserve.core.errors import InvalidInput, Unsupported
from lmiserve.core.tensors import ModelSignature
from lmiserve.protocols.tensor.codecs.tfjson import dump, format_floats, json_type

TF_DTYPES = {
    "BOOL": "DT_BOOL", "UINT8": "DT_UINT8", "UINT16": "DT_UINT16", "UINT32": "DT_UINT32", "UINT64": "DT_UINT64",
    "INT8": "DT_INT8", "INT16": "DT_INT16", "INT32": "DT_INT32", "INT64": "DT_INT64",
    "FP16": "DT_HALF", "FP32": "DT_FLOAT", "FP64": "DT_DOUBLE", "BYTES": "DT_STRING",
}  # fmt: skip
_TYPE_WORD = {"FP32": "float", "FP64": "double", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
              "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool",
              "BYTES": "string", "FP16": "half"}  # fmt: skip
_INT_RANGE = {"INT8": (-(2**31), 2**31 - 1), "INT16": (-(2**31), 2**31 - 1), "INT32": (-(2**31), 2**31 - 1),
              "UINT8": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1), "UINT32": (0, 2**32 - 1),
              "UINT64": (0, 2**64 - 1)}  # fmt: skip
_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "UINT8": np.uint8, "UINT32": np.uint32, "UINT64": np.uint64, "BOOL": np.bool_}  # fmt: skip


class _Invalid(Exception):
    """An INVALID_ARGUMENT status inside an element (wrapped by the caller)."""


def is_b64(value: object) -> bool:
    return isinstance(value, dict) and len(value) == 1 and "b64" in value


# ---- decoding --------------------------------------------------------------------------------------------


def decode_instances(instances: list, signature: ModelSignature) -> dict[str, np.ndarray]:
    specs = {t.name: t.datatype for t in signature.inputs}
    names = sorted(specs)
    first_is_object = isinstance(instances[0], dict) and not is_b64(instances[0])
    if len(names) > 1 and not first_is_object:
        raise InvalidInput(
            "instances is a plain list, but expecting list of objects as multiple input tensors "
            "required as per tensorinfo_map"
        )
    columns: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i, item in enumerate(instances):
        item_is_object = isinstance(item, dict) and not is_b64(item)
        if first_is_object and not item_is_object:
            raise InvalidInput(f"Expecting object but got list at item {i} of input list")
        if not first_is_object and item_is_object:
            raise InvalidInput(f"Expecting value/list but got object at item {i} of input list")
        if not item_is_object:
            columns[names[0]].append(
                _element(item, specs[names[0]], f"Failed to process element: {i} of 'instances' list. Error: ")
            )
            continue
        for key, value in item.items():
            prefix = f"Failed to process element: {i} key: {key} of 'instances' list. Error: "
            if key not in specs:
                raise InvalidInput(f"{prefix}INVALID_ARGUMENT: JSON object: does not have named input: {key}")
            columns[key].append(_element(value, specs[key], prefix))
        if set(item) != set(names):
            raise InvalidInput(
                f"Failed to process element: {i} of 'instances' list. "
                f"JSON object: {dump(item)} keys must be equal to: {','.join(names)}"
            )
    return {name: _stack(arrays) for name, arrays in columns.items()}


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    first = arrays[0]
    for array in arrays[1:]:
        if array.size != first.size:
            raise InvalidInput(f"Expecting tensor size: {first.size} but got: {array.size}")
        if array.shape != first.shape:
            raise InvalidInput(f"Expecting shape {_dims(first.shape)} but got: {_dims(array.shape)}")
    return np.stack(arrays) if first.dtype != object else _object_stack(arrays)


def _object_stack(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty((len(arrays), *arrays[0].shape), dtype=object)
    for i, array in enumerate(arrays):
        out[i, ...] = array
    return out


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def decode_inputs(inputs: object, signature: ModelSignature) -> dict[str, np.ndarray]:
    specs = {t.name: t.datatype for t in signature.inputs}
    if not isinstance(inputs, dict) or is_b64(inputs):
        if len(specs) > 1:
            raise InvalidInput(
                "inputs is a plain value/list, but expecting an object as multiple input tensors "
                "required as per tensorinfo_map"
            )
        name = next(iter(specs))
        return {name: _element(inputs, specs[name], "")}
    out = {}
    for name in sorted(specs):
        if name not in inputs:
            raise InvalidInput(f"Missing named input: {name} in 'inputs' object.")
        out[name] = _element(inputs[name], specs[name], "")
    return out


def _element(value: object, datatype: str, prefix: str) -> np.ndarray:
    """One tensor from nested JSON: shape from the first item per level, every sub-list checked."""
    if datatype not in _NUMPY and datatype != "BYTES":
        raise Unsupported(
            f"Conversion of JSON Value: {dump(_first_leaf(value))} to type: {_TYPE_WORD.get(datatype, datatype)}"
        )
    shape: list[int] = []
    probe = value
    while isinstance(probe, list):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    rank = len(shape)
    leaves: list = []
    try:
        _walk(value, rank, shape, datatype, leaves)
    except _Invalid as exc:
        raise InvalidInput(f"{prefix}INVALID_ARGUMENT: {exc}" if prefix else str(exc)) from None
    if datatype == "BYTES":
        array = np.empty(len(leaves), dtype=object)
        array[:] = leaves
    elif datatype == "BOOL":
        array = np.array(leaves, dtype=np.bool_)
    elif datatype in ("FP32", "FP64"):
        with np.errstate(over="ignore"):
            array = np.array(leaves, dtype=np.float64).astype(_NUMPY[datatype])
    else:
        array = np.array(leaves, dtype=np.int64 if datatype != "UINT64" else np.uint64).astype(_NUMPY[datatype])
    return array.reshape(shape)


def _walk(value: object, rank: int, shape: list[int], datatype: str, leaves: list) -> None:
    stack = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, list):
            if level >= rank:
                raise _Invalid(f"Encountered list at unexpected level: {level} expected < {rank}")
            if len(node) != shape[level]:
                raise _Invalid(
                    f"Encountered list at unexpected size: {len(node)} at level: {level} expected size: {shape[level]}"
                )
            stack.extend((child, level + 1) for child in reversed(node))
            continue
        if level != rank:
            raise _Invalid(
                f"JSON Value: {dump(node)} found at incorrect level: {level + 1} in the JSON DOM. "
                f"Expected at level: {rank}"
            )
        leaves.append(_leaf(node, datatype))


def _first_leaf(value: object) -> object:
    while isinstance(value, list) and value:
        value = value[0]
    return value


def _leaf(value: object, datatype: str) -> object:
    if datatype == "BYTES":
        if isinstance(value, str):
            return value.encode("utf-8")
        if isinstance(value, dict) and "b64" in value:
            if not is_b64(value) or not isinstance(value["b64"], str):
                raise _Invalid(f"JSON Value: {dump(value)} not formatted correctly for base64 data")
            return _b64decode(value["b64"])
    elif datatype == "BOOL":
        if isinstance(value, bool):
            return value
    elif datatype in ("FP32", "FP64"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        low, high = _INT_RANGE[datatype]
        if low <= value <= high:
            return value
    raise _Invalid(
        f"JSON Value: {dump(value)} Type: {json_type(value)} is not of expected type: {_TYPE_WORD[datatype]}"
    )


def _b64decode(text: str) -> bytes:
    try:
        padded = text + "=" * (-len(text) % 4)
        return base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise _Invalid("Unable to base64 decode") from None


# ---- encoding --------------------------------------------------------------------------------------------


def render(array: np.ndarray, name: str) -> str:
    """One tensor as nested JSON text with TF Serving's value encoding."""
    return _nested(tokens(np.asarray(array), name))


def tokens(array: np.ndarray, name: str) -> np.ndarray:
    """An object array of the same shape holding each element's JSON text."""
    kind = array.dtype.kind
    flat = array.reshape(-1)
    if kind == "f" and array.dtype.itemsize in (4, 8):
        texts = format_floats(flat)
    elif kind in "iu":
        texts = [str(v) for v in flat.tolist()]
    elif kind == "b":
        texts = ["true" if v else "false" for v in flat.tolist()]
    elif kind in "OSU":
        as_b64 = name.endswith("_bytes")
        texts = [_string(v, as_b64) for v in (flat.tolist() if kind != "O" else list(flat))]
    else:
        raise InvalidInput(f"Failed to write JSON value for tensor type: {TF_DTYPES.get(_v2(array), str(array.dtype))}")
    out = np.empty(len(texts), dtype=object)
    out[:] = texts
    return out.reshape(array.shape)


def _nested(texts: np.ndarray | str) -> str:
    if isinstance(texts, str):  # one row of a rank-1 tensor
        return texts
    if texts.ndim == 0:
        return str(texts[()])
    if texts.ndim == 1:
        return "[" + ", ".join(texts.tolist()) + "]"
    return "[" + ", ".join(_nested(sub) for sub in texts) + "]"


def _v2(array: np.ndarray) -> str:
    return {np.dtype(np.float16): "FP16", np.dtype(np.uint16): "UINT16"}.get(array.dtype, "")


def _string(value: object, as_b64: bool) -> str:
    import json

    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    if as_b64:
        return '{"b64": "' + base64.b64encode(raw).decode("ascii") + '"}'
    return json.dumps(raw.decode("utf-8", errors="replace"), ensure_ascii=False)


def render_rows(outputs: dict[str, np.ndarray]) -> str:
    """`predictions`: one output -> its rows; several -> one object per row."""
    if not outputs:
        raise InvalidInput("Cannot convert empty tensor map to JSON")
    batch = None
    for name, array in outputs.items():
        if np.ndim(array) < 1:
            raise InvalidInput(f"Tensor name: {name} has no shape information ")
        if batch is None:
            batch = array.shape[0]
        elif array.shape[0] != batch:
            raise InvalidInput(f"Tensor name: {name} has inconsistent batch size: {array.shape[0]} expecting: {batch}")
    if len(outputs) == 1:
        return render(next(iter(outputs.values())), next(iter(outputs)))
    texts = {name: tokens(np.asarray(a), name) for name, a in outputs.items()}
    rows = []
    for i in range(batch or 0):
        members = [f'        "{name}": {_nested(t[i])}' for name, t in texts.items()]
        rows.append("{\n" + ",\n".join(members) + "\n    }")
    return "[" + ", ".join(rows) + "]"


def render_columns(outputs: dict[str, np.ndarray]) -> str:
    if not outputs:
        raise InvalidInput("Cannot convert empty tensor map to JSON")
    if len(outputs) == 1:
        return render(next(iter(outputs.values())), next(iter(outputs)))
    members = [f'        "{name}": {render(array, name)}' for name, array in outputs.items()]
    return "{\n" + ",\n".join(members) + "\n    }"
