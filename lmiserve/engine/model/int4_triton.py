"""A Triton kernel for AWQ/GPTQ 4-bit weights on CUDA (issue #39): ``y = x @ W.T`` with
``W[o, i] = (code - zero[g(i), o]) * scale[g(i), o]``, de-quantized tile by tile in registers (the weight
is read as 4-bit codes, never written out in bf16).

Measured on an H200 (2026-11-29, benchmarks/README.md): correct (the engine tests pass on CUDA with it),
but slow: 30-95 GB/s of weights replayed in a CUDA graph, against 2.4-3.9 TB/s for bf16 products of
the de-quantized weight (10-30x the time at one row, ~28x at 128 rows). So it is not wired into loading:
`quant_formats.int4_module` de-quantizes AWQ/GPTQ to bf16 on CUDA (`USE_ON_CUDA` stays False; set it to
try the kernel). A fast 4-bit product needs a Marlin-style kernel (codes pre-shuffled for the tensor cores).

Since that run (2026-11-30, not yet measured on a GPU): that kernel read a fp32 scale and zero for every
input of a tile (``[BLOCK_K, BLOCK_N]`` gathers through ``g_idx``), 16x the bytes of the codes themselves.
Groups that are contiguous runs of a multiple of `GROUP_TILE` inputs (AWQ's, GPTQ's; act-order's once its
inputs are stored in group order, the activations' columns taken in that order at each call) now read one
row of scales and zeros a tile (`GROUP`); other layouts keep the per-input gathers.

Layout (`Int4TritonLinear.from_parts`): ``qweight`` int32 ``[in / 8, out]`` (GPTQ's: 8 consecutive inputs
a word, nibble k = input 8r + k), ``scales`` ``[groups, out]`` and ``zeros`` ``[groups, out]`` in fp32
(zeros as numbers of steps), ``g_idx`` int32 ``[in]`` (any order: GPTQ's ``desc_act`` too).
Tiles: `BLOCK_M` rows x `BLOCK_N` outputs, `BLOCK_K` inputs a step, fp32 accumulation."""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

USE_ON_CUDA = False  # measured on an H200: 10-30x slower than the de-quantized bf16 products (module doc)
GROUP_TILE = 32  # `int4_matmul`'s block_k: groups of a multiple of it read their scales once a tile

__all__ = ["USE_ON_CUDA", "Int4TritonLinear", "available", "contiguous_group_size", "int4_matmul"]


def available() -> bool:
    return triton is not None


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.int4_triton_kernel import int4_matmul_kernel

    return triton.jit(int4_matmul_kernel)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = GROUP_TILE,
    group: int = 0,
) -> torch.Tensor:
    """``x @ W.T`` for a 2-D `x` ``[M, K]`` and the 4-bit weight of `Int4TritonLinear`'s layout; `group` > 0
    (a multiple of `block_k`): the inputs' groups are contiguous runs of that many (`g_idx` unread)."""
    if group % block_k:
        raise ValueError(f"a group of {group} inputs is not a multiple of the kernel's {block_k}")
    if triton is None:
        raise RuntimeError("the int4 Triton kernel needs triton")
    x = x.contiguous()
    rows, inputs = x.shape
    outputs = qweight.shape[1]
    y = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outputs, block_n))
    _kernel()[grid](
        x, qweight, scales, zeros, g_idx, y, rows, outputs, inputs, x.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y


def contiguous_group_size(g_idx: torch.Tensor, groups: int) -> int | None:
    """The size of the groups when every one of the `groups` is a run of consecutive inputs
    (``g_idx[i] = i // size``), else None."""
    inputs = g_idx.shape[0]
    if not groups or inputs % groups:
        return None
    size = inputs // groups
    expected = torch.arange(inputs, device=g_idx.device) // size
    return size if torch.equal(g_idx.long(), expected) else None


class Int4TritonLinear(torch.nn.Module):
    """A 4-bit AWQ/GPTQ linear for CUDA on `int4_matmul` (slow: see the module's doc). Its tensors are plain
    attributes (`qweight`, `scales`, `zeros`, `g_idx`) and it has no `weight`, so the fast path leaves a
    model of them to the generic runner."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        bias: torch.Tensor | None,
        order: torch.Tensor | None = None,
        group: int = 0,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = g_idx.shape[0], qweight.shape[1]
        self.qweight, self.scales, self.zeros, self.g_idx, self.bias = qweight, scales, zeros, g_idx, bias
        self.order = order  # GPTQ's act-order: the inputs in group order (the codes' rows are stored so)
        self.group = group  # the groups' size once in order (0: not uniform, a scale gathered per input)

    @classmethod
    def from_parts(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        g_idx: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Int4TritonLinear:
        """From codes ``[out, in]``, scale and zero ``[out, groups]`` (`quant_formats.Int4Parts`). Inputs
        whose groups are not in order (GPTQ's act-order) are stored in group order, and each call takes the
        activations' columns in that order: the groups are then contiguous runs, whose scales and zeros the
        kernel reads once a tile instead of once an input."""
        order = None
        if bool((g_idx[1:] < g_idx[:-1]).any()):
            order = torch.argsort(g_idx, stable=True)
            codes, g_idx = codes[:, order], g_idx[order]
        size = contiguous_group_size(g_idx, scale.shape[1]) or 0
        nibbles = codes.t().to(torch.int64).reshape(-1, 8, codes.shape[0])  # [in / 8, 8, out]
        words = (nibbles << (torch.arange(8, device=codes.device) * 4)[None, :, None]).sum(1)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return cls(
            words.to(device),
            scale.t().contiguous().to(device, torch.float32),  # fp32: a fp16 scale exactly (bf16 would round it)
            zero.t().contiguous().to(device, torch.float32),
            g_idx.to(device, torch.int32),
            None if bias is None else bias.detach().to(device, dtype),
            order=None if order is None else order.to(device),
            group=size if size % GROUP_TILE == 0 else 0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.order is not None:
            rows = rows.index_select(1, self.order)
        y = int4_matmul(rows, self.qweight, self.scales, self.zeros, self.g_idx, group=self.group)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit (Triton)"
