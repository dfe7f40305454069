"""What a CUDA graph cannot capture, and what makes the host wait for the GPU, found on a CPU.

The decode graphs' step (engine/attention/cuda_graphs.py `DecodeGraphs._step`, "tensor ops alone, no host
values, no host syncs") runs on a CPU without a capture, so a host sync or a host value slipped into it
would pass every CPU test and first fail on a GPU, where a failed capture turns every graph off. An eager
step may hold host values, but each sync in it stalls the host until the GPU has run everything queued
before (with overlap scheduling, the step before it). `watch` runs a call under two torch modes and
records each hazard, of two kinds:

- `Hazards.syncs`, the host waits for the device: a tensor's value read on the host (``item``, ``bool``,
  ``int``, ``float``, an index; aten's ``_local_scalar_dense``, also when C++ reads it), ``tolist``,
  ``numpy``, ``cpu``; the ops whose output's shape depends on the values (``nonzero``, ``masked_select``,
  ``unique``, a boolean mask's indexing, ``repeat_interleave`` without its output size); and a blocking copy
  of host data to the device (``torch.tensor(..., device=...)``, ``.to(device)`` of a tensor made from host
  data without ``non_blocking=True``: torch synchronizes the stream after such a copy). A capture refuses
  each of them;
- `Hazards.host_data`, a tensor made from host data (``torch.tensor``, ``as_tensor``, ``from_numpy``): a
  capture records its copy once, so every replay would read the values of the step that was captured.

Calls made by Triton's interpreter (a kernel's launch, which on a GPU is one launch a graph records) and by
the CPU's own kernels (`CPU_ONLY`: numba products that serve CPU tensors alone, so never a GPU's step) are
not hazards.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")

# aten ops that read a device value on the host (a sync) or whose output's shape depends on the values
# (`item` and `is_nonzero` where inference mode keeps them whole, `_local_scalar_dense` otherwise)
_SYNC_OPS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select", "_unique2")
_SYNC_OPS += ("unique_dim", "unique_consecutive")
# `multinomial` reads two values of its input on the host before it draws (torch's one-sample path, ATen's
# Distributions.cpp: "probability tensor contains either `inf`, `nan` or element < 0", "sum of probabilities
# <= 0"), inside its kernel, where the watch does not see them
_SYNC_OPS += ("multinomial",)
# torch functions that read a value on the host or copy to the host
_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "cpu"}
_MADE = {"tensor", "as_tensor"}  # a tensor of host data (with a device: also a blocking copy there)
_LIFTED = {"lift_fresh", "lift_fresh.default"}  # `from_numpy`'s tensor
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_", "index"}
# the CPU's kernels (engine/model, engine/attention, engine/lora): they serve CPU tensors alone
CPU_ONLY = ("skinny_gemm.py", "q4_decode.py", "group_kernels.py", "cpu_kernel.py", "lora/kernels.py")


@dataclass
class Hazards:
    """The hazards found, each ``(what, where)``: the op or function, and the first frame outside torch."""

    syncs: list[tuple[str, str]] = field(default_factory=list)
    host_data: list[tuple[str, str]] = field(default_factory=list)

    @property
    def found(self) -> list[tuple[str, str]]:
        """Both kinds: what a captured step must not hold."""
        return self.syncs + self.host_data

    def clear(self) -> None:
        self.syncs.clear()
        self.host_data.clear()


def _not_on_cuda() -> bool:
    """Whether the call comes from Triton's interpreter or a CPU kernel (not a hazard)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/triton/" in name or name.endswith(CPU_ONLY):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("/helpers/capture_hazards.py"):
            return f"{name.rpartition('/')[2]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _bool_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """An index (the second argument, or `indices`) that is or holds a boolean mask; a boolean value put
    (``index_put_(indices, values)``, ``x[i] = mask``) is not one."""

    def masks(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.dtype == torch.bool
        if isinstance(value, (tuple, list)):
            return any(masks(v) for v in value)
        return False

    return (len(args) > 1 and masks(args[1])) or masks(kwargs.get("indices"))


def _blocking_copy(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], host: dict[int, Any]) -> bool:
    """A copy to a device the host waits for: ``tensor``/``as_tensor`` with a device; ``to`` with a device
    (not ``non_blocking=True``) or ``cuda`` of a tensor made from host data in the call (`host`; on a CPU
    every tensor is on the device, so a tensor's own ``.to(its device)`` is not one)."""
    if name in _MADE:
        return kwargs.get("device") is not None
    if name not in ("to", "cuda") or not args or (ref := host.get(id(args[0]))) is None or ref() is not args[0]:
        return False
    if name == "cuda":
        return not kwargs.get("non_blocking", False)
    device = kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])
    blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True)
    return device and blocking


class _Functions(TorchFunctionMode):
    def __init__(self, hazards: Hazards) -> None:
        super().__init__()
        self.hazards = hazards
        self.host: dict[int, Any] = {}  # the tensors made from host data so far: id -> a weak reference

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        sync = name in _READS or _blocking_copy(name, args, kwargs, self.host)
        sync = sync or (name in _INDEXING and _bool_index(args, kwargs))
        made = name in _MADE or name in _LIFTED
        if (sync or made) and not _not_on_cuda():
            where = _where()
            if sync:
                self.hazards.syncs.append((name, where))
            if made:
                self.hazards.host_data.append((name, where))
        out = func(*args, **kwargs)
        if made and isinstance(out, torch.Tensor) and kwargs.get("device") is None:  # (with one: on it)
            self.host[id(out)] = weakref.ref(out)
        elif name in ("to", "cuda") and args and out is args[0]:
            self.host.pop(id(out), None)  # (on a CPU the copy to the device is the tensor itself: now there)
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, hazards: Hazards) -> None:
        super().__init__()
        self.hazards = hazards

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        hazard = op in _SYNC_OPS or (op == "repeat_interleave" and kwargs.get("output_size") is None)
        if hazard and not _not_on_cuda():
            self.hazards.syncs.append((f"aten.{op}", _where()))
        return func(*args, **kwargs)


def watch(hazards: Hazards, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, its hazards recorded in `hazards`."""
    with _Functions(hazards), _Ops(hazards):
        return call(*args, **kwargs)
