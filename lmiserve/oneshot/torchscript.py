"""A TorchScript module as a one-shot tensor model: numeric tensors in, numeric tensors out.

Inputs and outputs are declared in settings (`input_names`, `input_dtypes`, `input_shapes`, and the
`output_*` keys); `prepare` checks each request against them (names, datatype, rank and fixed
dimensions; numbers of the same kind are cast, as LMI's JSON numbers come untyped) and converts to the
declared dtype, so a bad tensor is a 400-class error before it is
queued. `forward` calls the module with the inputs in declared order; a tuple/list result maps to the
output names in order, a dict by name, a single tensor to the first output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lmiserve.core.errors import GenerationFailed, InvalidRequest
from lmiserve.core.tensor_io import check_names
from lmiserve.core.tensors import (
    NUMPY_DTYPES,
    ModelSignature,
    TensorRequest,
    TensorSpec,
)


class TorchScriptRunner:
    kind = "torchscript"

    def __init__(
        self, module: torch.jit.ScriptModule, signature: ModelSignature, *, path: Path, device: torch.device
    ) -> None:
        self.module = module
        self.signature = signature
        self.path = path
        self.device = device

    def prepare(self, request: TensorRequest) -> dict[str, np.ndarray]:
        check_names(request.inputs, self.signature, "")  # OneShotModel checked them with the model's name
        return {s.name: _check(request.inputs[s.name], s) for s in self.signature.inputs}

    @torch.inference_mode()
    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(inputs[s.name])).to(self.device) for s in self.signature.inputs]
        result = self.module(*args)
        names = [s.name for s in self.signature.outputs]
        if isinstance(result, torch.Tensor):
            values = {names[0]: result}
        elif isinstance(result, dict):
            values = {n: result[n] for n in names if n in result}
        elif isinstance(result, (tuple, list)):
            values = dict(zip(names, result))
        else:
            raise GenerationFailed(f"the TorchScript module returned {type(result).__name__}, not tensors")
        missing = [n for n in names if n not in values]
        if missing:
            raise GenerationFailed(f"the TorchScript module did not return output '{missing[0]}'")
        out = {}
        for spec in self.signature.outputs:
            value = values[spec.name]
            if not isinstance(value, torch.Tensor):
                raise GenerationFailed(f"output '{spec.name}' is {type(value).__name__}, not a tensor")
            out[spec.name] = value.detach().cpu().numpy().astype(NUMPY_DTYPES[spec.datatype], copy=False)
        return out


def _check(value: np.ndarray, spec: TensorSpec) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object or array.dtype.kind in "SUV":
        raise InvalidRequest(f"input '{spec.name}' must be {spec.datatype}, got text/bytes")
    if len(array.shape) != len(spec.shape):
        raise InvalidRequest(f"input '{spec.name}' must have shape {_shape(spec.shape)}, got {_shape(array.shape)}")
    for want, got in zip(spec.shape, array.shape):
        if want != -1 and want != got:
            raise InvalidRequest(f"input '{spec.name}' must have shape {_shape(spec.shape)}, got {_shape(array.shape)}")
    target = NUMPY_DTYPES[spec.datatype]
    if array.dtype != target and not np.can_cast(array.dtype, target, casting="same_kind"):
        raise InvalidRequest(f"input '{spec.name}' must be {spec.datatype}, got {array.dtype}")
    return array.astype(target, copy=False)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
