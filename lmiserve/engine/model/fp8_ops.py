"""fp8 weights' arithmetic (issue #39), below `quantize` and `quant_formats`: per-channel quantization (vLLM's
dynamic fp8), de-quantization, and the product: up to `fp8_gemv.MAX_ROWS` rows on a GPU through `fp8_gemv`'s
weight-only Triton kernel or `fp8_w8a8`'s (cuBLAS's tensor-wise product) where one measures faster, else through
``torch._scaled_mm`` with activations quantized per row; on a GPU without fp8 products (below compute capability
8.9) every row count through `fp8_gemv`'s kernel, which widens the bytes itself, or the weight de-quantized a
slice at a time. ``_scaled_mm`` alone, measured on an H200 (2026-11-29, benchmarks/README.md), was correct but
slower than bf16 at decode sizes: in a CUDA graph the per-row quantization adds ~20 us a product, and torch's
row-wise ``_scaled_mm`` reads 0.5-1.9 TB/s of fp8 weights where bf16 reads 2.4-3.9 TB/s; the 8B shape at one
stream decoded at 0.74x bf16."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv, kernel_choice
from lmiserve.engine.model.fp8_w8a8 import FP8_MAX, rows_to_fp8

__all__ = [
    "FP8_MAX",
    "PER_TENSOR",
    "dequantize_fp8",
    "fp8_linear",
    "per_tensor_at_load",
    "quantize_fp8",
    "rows_to_fp8",
    "scaled_product",
]

# ``quantize=fp8``'s scales (`per_tensor_at_load`): True (LMISERVE_FP8_PER_TENSOR=1) one a tensor everywhere; False
# (=0) one an output channel everywhere; None (unset) one a tensor on a GPU with fp8 products, else a channel
PER_TENSOR = kernel_choice.switch("LMISERVE_FP8_PER_TENSOR")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight * scale`` in fp32 ``[out, in]``: `scale` per channel (``[out]`` or ``[out, 1]``), per tensor, or
    each row's by blocks of inputs (``[out, blocks]``, `fp8_gemv.block_scales`)."""
    if scale.dim() == 2 and scale.shape[1] > 1:
        return fp8_gemv.dequantized_weight(weight, scale)
    s = scale.float().reshape(-1)
    return weight.float() * (s[:, None] if s.numel() > 1 else s)


def quantize_fp8(
    weight: torch.Tensor, amax: torch.Tensor | None = None, per_tensor: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel fp8 of a float weight: ``scale = max|w| / 448`` (fp32 ``[out]``; `amax`: each row's
    ``max|w|`` when `weight` holds only some of its columns), ``q = w / scale`` rounded to ``float8_e4m3fn``.
    `per_tensor` (vLLM's online fp8): one scale over the whole weight (``[1]``; `amax`: the whole weight's
    ``max|w|``, one value, when `weight` is a tensor-parallel rank's part of it)."""
    w = weight.detach().float()
    if per_tensor:
        whole = w.abs().amax().reshape(1, 1) if amax is None else amax.float().reshape(1, 1)
        q, scale = rows_to_fp8(w, whole.expand(w.shape[0], 1))
        return q, scale[:1, 0].contiguous()
    q, scale = rows_to_fp8(w, None if amax is None else amax.float().reshape(-1, 1))
    return q, scale[:, 0]


def per_tensor_at_load(device: torch.device) -> bool:
    """Whether ``quantize=fp8`` quantizes a float checkpoint's linears per tensor on `device` (`PER_TENSOR`; unset:
    on a GPU with fp8 products, where one row's product runs on cuBLAS's tensor-wise fp8 product with both scales
    applied there, `fp8_w8a8.ONE_SCALE`, as vLLM's online fp8; elsewhere per channel, the closer: a CPU
    de-quantizes at load, and an A100's widening kernel applies a scale a channel at no cost)."""
    if PER_TENSOR is not None:
        return PER_TENSOR
    return device.type == "cuda" and fp8_devices.native(device)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = rows_to_fp8,
    int8_rows: bool = False,
) -> torch.Tensor:
    """``x @ (weight * scales).T`` for a 2-D `x`, fp8 `weight` ``[out, in]`` and fp32 `scales` ``[out]`` (or each
    row's by blocks of inputs, ``[out, blocks]``): through `fp8_gemv` where it is chosen (measured faster on this
    GPU: a few rows, or any number where the GPU has no fp8 products or the scales are by blocks), else
    `scaled_product` (there, and for blocks, `fp8_gemv.dequantized_product`). An ``int8`` `weight` (8-bit integer
    codes, `int8_weights`) runs the kernel or the de-quantized product, never ``_scaled_mm``; with `int8_rows`
    (W8A8's) `int8_w8a8`'s product with the rows in int8 is a candidate too."""
    if fp8_gemv.to_scaled_mm(weight, scales, x.device):
        other = functools.partial(scaled_product, weight=weight, scales=scales, quantize_rows=quantize_rows)
    else:
        other = functools.partial(fp8_gemv.dequantized_product, weight=weight, scales=scales)
    choice = fp8_gemv.choose(x, weight, scales, other, int8_rows)
    if choice is not None:
        return fp8_gemv.product(x, weight, scales, choice)
    return other(x)


def scaled_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = rows_to_fp8,
) -> torch.Tensor:
    """`fp8_linear` through ``torch._scaled_mm``: `x` quantized to fp8 per row (``max|x| / 448``;
    `quantize_rows`, which a benchmark replaces by a compiled one), one ``torch._scaled_mm`` with row-wise
    scales (bf16 out, as Hopper's row-wise fp8 GEMM requires), rows padded to a multiple of 16."""
    rows = x.shape[0]
    xq, x_scale = quantize_rows(x.float())
    pad = (-rows) % 16
    if pad:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        x_scale = torch.nn.functional.pad(x_scale, (0, 0, 0, pad), value=1.0)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16)
    return y[:rows].to(x.dtype)
