"""Protocol-free tensor requests: what TF Serving, KServe V2, SageMaker and Vertex payloads become.

Every tensor protocol decodes its payload into a `TensorRequest` (named numpy arrays; BYTES tensors are
object arrays of `bytes`), hands it to the addressed model's `TensorModel.infer`, and encodes the
returned named arrays back into its own wire format. A model describes itself with a `ModelSignature`
(V2 datatype names; -1 marks a variable dimension; dimension 0 is the batch). An optional input may be
left out of a request; every other declared input is required, and no undeclared input is accepted
(`core/tensor_io.py` checks requests against the signature).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}  # V2 datatype names -> numpy


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES
    shape: tuple[int, ...]
    optional: bool = False  # an input a request may leave out (outputs ignore it)


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def required(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if not t.optional)


def datatype_of(array: np.ndarray) -> str | None:
    """The V2 datatype of an array (str/bytes/object arrays are BYTES); None for dtypes V2 has no name for."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    return next((name for name, dtype in NUMPY_DTYPES.items() if dtype == array.dtype), None)


@dataclass
class TensorRequest:
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] | None = None  # requested output names; None = all


class TensorModel(Protocol):
    """A model any tensor protocol can call. `infer` raises core errors (InvalidRequest, ...) for bad input."""

    kind: str  # "llm", "embedding", "classifier", "regression", "torchscript"
    signature: ModelSignature

    async def infer(self, request: TensorRequest) -> dict[str, np.ndarray]: ...
