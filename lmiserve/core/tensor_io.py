"""Checks shared by every tensor model: pick a named input, read text rows, keep requested outputs.

All failures raise `InvalidRequest` with a message naming the tensor, so every protocol can answer
it as its own 4xx.
"""

from __future__ import annotations

import numpy as np

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.tensors import ModelSignature, TensorRequest


def pick_input(request: TensorRequest, name: str, *, aliases: tuple[str, ...] = ()) -> np.ndarray:
    """The input called `name` (or one of `aliases`); with a single input, that one whatever its name."""
    if not request.inputs:
        raise InvalidRequest(f"the request has no inputs; expected input '{name}'")
    for candidate in (name, *aliases):
        if candidate in request.inputs:
            return request.inputs[candidate]
    if len(request.inputs) == 1:
        return next(iter(request.inputs.values()))
    given = ", ".join(sorted(request.inputs))
    raise InvalidRequest(f"unknown inputs {given}: this model takes one input '{name}'")


def text_rows(array: np.ndarray, name: str) -> list[str]:
    """One string per element of a BYTES tensor (any shape; a scalar is one row), UTF-8 decoded."""
    values = np.asarray(array, dtype=object).reshape(-1)
    if values.size == 0:
        raise InvalidRequest(f"input '{name}' is empty")
    rows = []
    for value in values:
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                rows.append(bytes(value).decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidRequest(f"input '{name}' holds bytes that are not UTF-8 text") from None
        elif isinstance(value, str):
            rows.append(value)
        else:
            raise InvalidRequest(f"input '{name}' must hold text (BYTES), got {type(value).__name__}")
    return rows


def bytes_column(texts: list[str]) -> np.ndarray:
    """A BYTES tensor of shape [len(texts)]: an object array of UTF-8 `bytes`."""
    out = np.empty(len(texts), dtype=object)
    out[:] = [t.encode("utf-8") for t in texts]
    return out


def select_outputs(
    outputs: dict[str, np.ndarray], request: TensorRequest, signature: ModelSignature
) -> dict[str, np.ndarray]:
    """All outputs, or only the requested ones; an unknown requested name is an InvalidRequest."""
    if request.outputs is None:
        return outputs
    known = [t.name for t in signature.outputs]
    unknown = [n for n in request.outputs if n not in outputs]
    if unknown:
        raise InvalidRequest(f"unknown output '{unknown[0]}': this model's outputs are {', '.join(known)}")
    return {n: outputs[n] for n in request.outputs}
