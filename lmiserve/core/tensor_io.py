"""Checks shared by every tensor model and protocol: a request's inputs against the model's signature,
text rows, requested outputs.

`conform` is the one input check every tensor protocol runs (KServe V2, TF Serving, SageMaker, Vertex;
Triton's words): names (`check_names`: no undeclared input, every required one present), datatypes
(exactly the declared one unless the caller allows a numeric cast) and shapes (`fit_shape`: same rank,
-1 matches any size, `[N]` and `[N, 1]` interchangeable). The models call `check_names` again, so no
caller can hand a model an input it does not declare. All failures raise `InvalidInput` naming the
tensor, so every protocol answers them as its own 400.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np

from lmiserve.core.errors import InvalidInput, InvalidRequest
from lmiserve.core.tensors import NUMPY_DTYPES, ModelSignature, TensorRequest, datatype_of


def check_names(names: Iterable[str], signature: ModelSignature, model: str) -> None:
    """Every name declared by the signature, every required input given."""
    given = list(names)
    unexpected = [n for n in given if signature.input(n) is None]
    if len(unexpected) == 1:
        raise InvalidInput(f"unexpected inference input '{unexpected[0]}' for model '{model}'")
    if unexpected:
        raise InvalidInput(f"unexpected inference inputs {_names(unexpected)} for model '{model}'")
    missing = [t.name for t in signature.required if t.name not in given]
    if missing:
        total, required = len(signature.inputs), len(signature.required)
        expected = (
            f"expected {total} inputs"
            if total == required
            else f"expected number of inputs between {required} and {total}"
        )
        raise InvalidInput(
            f"{expected} but got {len(given)} inputs for model '{model}'. Got input(s) {_names(given)}, "
            f"but missing required input(s) {_names(missing)}. Please provide all required input(s)."
        )


def conform(
    inputs: Mapping[str, np.ndarray], signature: ModelSignature, model: str, *, castable: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """The inputs checked against the signature (names, datatypes, shapes), in signature order.

    Inputs named in `castable` may hold another numeric datatype; they are cast to the declared one.
    """
    check_names(inputs, signature, model)
    out = {}
    for spec in signature.inputs:
        if spec.name not in inputs:
            continue  # an optional input left out
        array = inputs[spec.name]
        got = datatype_of(array)
        if got != spec.datatype:
            numeric = got not in (None, "BYTES") and spec.datatype != "BYTES"
            if not (numeric and spec.name in castable):
                raise InvalidInput(
                    f"inference input '{spec.name}' data-type is '{got or array.dtype}', "
                    f"but model '{model}' expects '{spec.datatype}'"
                )
            array = array.astype(NUMPY_DTYPES[spec.datatype])
        out[spec.name] = fit_shape(array, spec.shape, spec.name, model)
    return out


def fit_shape(array: np.ndarray, expected: Sequence[int], name: str, model: str) -> np.ndarray:
    """Check an input's shape against the signature (-1 = any); [N] and [N, 1] are interchangeable."""
    shape = array.shape
    if _matches(shape, expected):
        return array
    if len(shape) == len(expected) + 1 and shape[-1] == 1 and _matches(shape[:-1], expected):
        return array.reshape(shape[:-1])
    if len(shape) + 1 == len(expected) and expected[-1] in (1, -1) and _matches((*shape, 1), expected):
        return array.reshape((*shape, 1))
    raise InvalidInput(
        f"unexpected shape for input '{name}' for model '{model}'. Expected {_dims(expected)}, got {_dims(shape)}"
    )


def _matches(shape: Sequence[int], expected: Sequence[int]) -> bool:
    return len(shape) == len(expected) and all(e == -1 or e == s for s, e in zip(shape, expected))


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names(names: Sequence[str]) -> str:
    """Triton's list of names: ['a','b']."""
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def model_input(request: TensorRequest, signature: ModelSignature, name: str, model: str) -> np.ndarray:
    """The declared input `name` of a request whose input names `check_names` accepts."""
    check_names(request.inputs, signature, model)
    return request.inputs[name]


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
