"""Whether a decode step runs `fused_norm`'s kernels, measured on the GPU that serves (issue #39).

The fused kernels (a residual add with its RMS norm, SiLU with its product, the rotary embedding of the q and k
heads with the keys' and values' store in the cache) replace about 17 small kernels a layer; whether that is
faster depends on the GPU, the model's widths and the step's rows, so no default suits every deployment (an H200
and an L4 differ). Unless
``LMISERVE_FUSED_ELEMENTWISE`` forces them on (``1``) or off (``0``), the first forward built for a model's shapes
on a CUDA device measures one layer's element-wise work both ways (`measure`): each way's results are checked
against the other's (more than `kernel_choice.TOLERANCE` apart: the kernels are refused, logged), then each way
is captured `kernel_choice.REPEATS` times in a CUDA graph, as the decode graphs replay it, and timed at 1, 16 and
128 rows. The fused kernels serve where they are faster at every row count; the choice and its times are logged
once for the shapes (`chosen`).

A tensor-parallel rank does not measure (each rank's timing could differ, and the ranks must run the same
arithmetic): its steps keep the eager ops unless ``LMISERVE_FUSED_ELEMENTWISE=1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmiserve.engine.attention import kv_quant
from lmiserve.engine.attention.backend_base import KvStore
from lmiserve.engine.model import fused_norm, kernel_choice, layer_ops

__all__ = ["ROWS", "LayerShape", "Verdict", "chosen", "measure"]

log = logging.getLogger(__name__)

ROWS = (1, 16, 128)  # the decode rows measured: one stream, a small batch, a full one


@dataclass(frozen=True)
class LayerShape:
    """The widths one layer's element-wise work runs over: the hidden state, the MLP's intermediate (0: no dense
    gated MLP), the q and k heads the rotary embedding turns (0: not rotated by the fused kernel) and the v
    heads after them, a head's size, the norms' epsilon, and whether each q and k head is normed before its
    rotation (Qwen3's)."""

    hidden: int
    intermediate: int
    rotated_heads: int
    v_heads: int
    head_dim: int
    eps: float
    head_norm: bool = False

    @classmethod
    def of(cls, fast: Any) -> LayerShape:
        """A `FastLlama`'s (whose every layer has an RMS norm before attention: `plain_norms`)."""
        dense = [layer for layer in fast.layers if layer.moe is None and layer.gated]
        rope = fast.rope
        rotated = rope.rotary_dim == fast.head_dim and not rope.interleaved
        norm = fast.layers[0].in_norm
        return cls(
            hidden=norm[0].numel(),
            intermediate=dense[0].intermediate if dense else 0,
            rotated_heads=fast.heads + fast.kv_heads if rotated and any(fast.rope_layers) else 0,
            v_heads=fast.kv_heads,
            head_dim=fast.head_dim,
            eps=float(norm[1]),
            head_norm=any(n is not None for n in fast.head_norms),
        )


@dataclass(frozen=True)
class Verdict:
    """`measure`'s answer: whether the fused kernels serve, the microseconds of each way at each row count
    (``{rows: (eager, fused)}``), and why not where they were refused."""

    fused: bool
    times_us: dict[int, tuple[float, float]]
    refused: str | None = None

    def as_dict(self) -> dict[str, Any]:
        times = {str(r): {"eager_us": round(e, 2), "fused_us": round(f, 2)} for r, (e, f) in self.times_us.items()}
        return {"fused": self.fused, "times": times, "refused": self.refused}


_verdicts: dict[tuple[Any, ...], Verdict] = {}


def chosen(shape: LayerShape, dtype: torch.dtype, device: torch.device, tensor_parallel: bool) -> bool:
    """Whether a forward of `shape` on `device` runs the fused kernels (`fused_norm.wanted` already said they
    may): forced by `fused_norm.USE_ON_CUDA` where it is set, else measured once for the shapes."""
    if fused_norm.USE_ON_CUDA is not None:
        return fused_norm.USE_ON_CUDA
    if tensor_parallel:
        return False
    key = (shape, dtype, str(device))
    if key not in _verdicts:
        _verdicts[key] = measure(shape, dtype, device)
        _log(shape, dtype, device, _verdicts[key])
    return _verdicts[key].fused


def measure(shape: LayerShape, dtype: torch.dtype, device: torch.device, rows: tuple[int, ...] = ROWS) -> Verdict:
    """One layer's element-wise work, eager and fused, at each of `rows` (see the module's doc)."""
    times: dict[int, tuple[float, float]] = {}
    try:
        for count in rows:
            inputs = _inputs(shape, dtype, device, count)
            eager, fused = _eager(shape, inputs), _fused(shape, inputs)
            for name, want, got in zip(_names(shape), eager(), fused(), strict=True):
                gap = (got.float() - want.float()).abs().max().item() / (want.float().abs().max().item() or 1.0)
                if not gap <= kernel_choice.TOLERANCE:  # (NaN too)
                    return Verdict(False, times, f"{name} off by {gap:.3g} at {count} row(s)")
            times[count] = (1e6 * kernel_choice.time_gpu(eager, device), 1e6 * kernel_choice.time_gpu(fused, device))
    except Exception as exc:  # noqa: BLE001 - a kernel this GPU or Triton cannot compile or capture: the eager ops
        return Verdict(False, times, f"{type(exc).__name__}: {str(exc)[:160]}")
    return Verdict(all(f < e for e, f in times.values()), times)


def _names(shape: LayerShape) -> list[str]:
    """What `_eager` and `_fused` return, in order."""
    names = ["the residual add and RMS norm", "the second add and norm"]
    stored = ["the rotary embedding of q", "the keys stored", "the values stored"]
    return names + ["SiLU and its product"] * bool(shape.intermediate) + stored * bool(shape.rotated_heads)


def _inputs(shape: LayerShape, dtype: torch.dtype, device: torch.device, rows: int) -> dict[str, torch.Tensor]:
    make = torch.Generator().manual_seed(rows)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=make).to(device, dtype)

    width = (shape.rotated_heads + shape.v_heads) * shape.head_dim
    angles = torch.arange(rows)[:, None] * (0.1 + torch.arange(shape.head_dim // 2))[None, :]
    slots = 2 * rows * shape.v_heads  # (a cache of twice the step's rows, each written to a row of its own)
    return {
        "write": torch.randperm(slots, generator=make)[: rows * shape.v_heads].to(device),
        "keys": torch.zeros(slots, shape.head_dim, dtype=dtype, device=device),
        "values": torch.zeros(slots, shape.head_dim, dtype=dtype, device=device),
        "x": rand(rows, shape.hidden),
        "residual": rand(rows, shape.hidden),
        "o": rand(rows, shape.hidden),
        "weight": (1 + 0.1 * torch.randn(shape.hidden, generator=make)).to(device, dtype),
        "gate_up": rand(rows, 2 * shape.intermediate),
        "qkv": rand(rows, width),
        "head_weight": (1 + 0.1 * torch.randn(shape.rotated_heads, shape.head_dim, generator=make)).to(device, dtype),
        "cos": torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None].to(device, dtype),
        "sin": torch.cat([-angles.sin(), angles.sin()], dim=-1)[:, None].to(device, dtype),
    }


Work = Callable[[], list[torch.Tensor]]


def _eager(shape: LayerShape, t: dict[str, torch.Tensor]) -> Work:
    """The ops `FastLlama._layers` runs without the kernels, one layer's element-wise work (with the keys and
    values stored as the Triton backend's `forward` stores them)."""
    norm, inter, heads = (t["weight"], shape.eps), shape.intermediate, shape.rotated_heads
    q_heads, dim = heads - shape.v_heads, shape.head_dim
    keys, values = t["keys"].clone(), t["values"].clone()

    def run() -> list[torch.Tensor]:
        x = t["x"] + t["residual"]
        h = layer_ops.rms_norm(x, norm)
        x2 = x + t["o"]
        out = [h, layer_ops.rms_norm(x2, norm)]
        if inter:
            out.append(F.silu(t["gate_up"][:, :inter]) * t["gate_up"][:, inter:])
        if heads:
            qk = t["qkv"][:, : heads * dim].view(-1, heads, dim)
            qk = layer_ops.rms_norm(qk, (t["head_weight"], shape.eps)) if shape.head_norm else qk
            qk = layer_ops.rotate(qk, t["cos"], t["sin"])
            v = t["qkv"][:, heads * dim :].view(-1, shape.v_heads, dim)
            kv_quant.store(keys, t["write"], qk[:, q_heads:].reshape(-1, dim))
            kv_quant.store(values, t["write"], v.reshape(-1, dim))
            out += [qk[:, :q_heads], keys, values]
        return out

    return run


def _fused(shape: LayerShape, t: dict[str, torch.Tensor]) -> Work:
    """The same work through `fused_norm`'s kernels (the rotation and the keys' and values' store in one)."""
    keys, values = t["keys"].clone(), t["values"].clone()
    store = KvStore(keys, values, t["write"], kv_quant.UNIT, t["qkv"].shape[0])
    head_norm = (t["head_weight"], shape.eps) if shape.head_norm else None

    def run() -> list[torch.Tensor]:
        x, h = fused_norm.add_rms_norm(t["x"], t["residual"], t["weight"], shape.eps)
        out = [h, fused_norm.add_rms_norm(x, t["o"], t["weight"], shape.eps)[1]]
        if shape.intermediate:
            out.append(fused_norm.silu_mul(t["gate_up"], shape.intermediate))
        if shape.rotated_heads:
            q_heads = shape.rotated_heads - shape.v_heads
            q = fused_norm.rope_store(t["qkv"], t["cos"], t["sin"], q_heads, shape.v_heads, store, head_norm)
            out += [q, keys, values]
        return out

    return run


def _log(shape: LayerShape, dtype: torch.dtype, device: torch.device, verdict: Verdict) -> None:
    timed = "; ".join(f"{r} row(s): fused {f:.1f} us, eager {e:.1f} us" for r, (e, f) in verdict.times_us.items())
    what = f"a layer's element-wise work ([{shape.hidden}], MLP {shape.intermediate}, {dtype})"
    if verdict.refused is not None:
        log.warning("%s keeps the eager ops: the fused kernels were refused (%s)", what, verdict.refused)
    else:
        runs = "the fused kernels (fused_norm)" if verdict.fused else "the eager ops"
        log.info("%s runs %s, measured on %s (%s)", what, runs, device, timed)
