"""fp8 weights times fp8 activations for a few rows through cuBLAS's tensor-wise fp8 product (issue #39: fp8 must
decode faster than bf16), one of the products `fp8_gemv.choose` measures for each weight shape and row bucket.

Why: on an H200 (2026-12-04, benchmarks/README.md) cuBLAS's fp8 product with one scale a tensor read the 8B
shape's weights at 3.0-3.9 TB/s at one row (gate+up 31 us, down 20 us), where torch's row-wise ``_scaled_mm``
(`fp8_ops.scaled_product`: a scale a row and a channel inside the product) read 1.3-3.3 TB/s and the
weight-only kernel (`fp8_gemv`) 1.2-2.8; torch's activation quantization there took several kernels a product.
Here a product is three kernels: `fp8_w8a8_kernel.quantize_rows_kernel` quantizes each row over its own range
(the numbers of `fp8_ops.rows_to_fp8`, ``max|row| / 448``: the same as the row-wise product's), rows padded to
16 (cuBLAS's fp8 product wants every dimension a multiple of 16); ``torch._scaled_mm`` with unit scales sums
in fp32; `fp8_w8a8_kernel.scale_rows_kernel` multiplies each sum by its row's and its channel's scale and
casts. So per-channel checkpoints (FBGEMM's, compressed-tensors' dynamic ones) and per-tensor ones run it
alike, with the row-wise product's accuracy.

One row of a weight with one scale (per tensor: what ``quantize=fp8`` makes on a GPU with fp8 products, as vLLM's
online fp8 does, and the per-tensor checkpoints of compressed-tensors and AutoFP8; `one_scale`) takes two kernels
(`ONE_SCALE`, `product_one_scale`): the row's scale and the weight's are cuBLAS's own (one a tensor each: a
single row's scale is its tensor's), so the product writes the row scaled, in its dtype, and the scaling kernel
goes. On the H200 that kernel and the fp32 sums it reads cost a few microseconds a product, some 128 launches
a step of the 8B shape (2026-12-04: the tensor-wise product alone 5.4 us for 4096 x 4096 in a graph).

Only where the GPU has fp8 products (`fp8_devices.native`; a CPU too, where torch has a ``_scaled_mm`` and the
tests run the kernels under Triton's interpreter), and for weights whose both dimensions are multiples of 16
(`applies`). Not yet measured as a whole on a GPU (the next GPU check's `quantized` step times it,
`fp8_w8a8` in its kernel table).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from lmiserve.engine import fp8_devices

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

__all__ = [
    "FP8_MAX",
    "ONE_SCALE",
    "PAD",
    "W8A8",
    "OneScale",
    "RowsInFp8",
    "applies",
    "given_rows",
    "one_scale",
    "product",
    "product_one_scale",
    "quantize_rows",
    "row_buffers",
    "rows_to_fp8",
    "scaled_rows",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
PAD = 16  # cuBLAS's fp8 product: every dimension a multiple of 16
BLOCK_N = 1024  # outputs of a row a program of the scaling kernel writes


class RowsInFp8:
    """The candidate product of this module, beside `fp8_gemv`'s tiles (one instance: `W8A8`)."""

    def __str__(self) -> str:
        return "cuBLAS fp8 x fp8, activations per row"

    def run(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The product (`product`)."""
        return product(x, weight, scales)

    def quantized(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 `rows` as the product takes them (in fp8, each over its range), back in fp32: what a candidate is
        checked against (`kernel_choice.pick`)."""
        q, scales = rows_to_fp8(rows)
        return q.float() * scales

    __repr__ = __str__


W8A8 = RowsInFp8()


class OneScale(RowsInFp8):
    """The candidate for one row of a weight with one scale (module doc; one instance: `ONE_SCALE`): the same
    arithmetic as `W8A8`'s, its scales applied by cuBLAS."""

    def __str__(self) -> str:
        return "cuBLAS fp8 x fp8, one scale a tensor"

    def run(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return product_one_scale(x, weight, scales)

    __repr__ = __str__


ONE_SCALE = OneScale()

# id(scales) -> (the scales, whether they are one value): read once a tensor, while it lives
_one_scale: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}
# the rows last given in fp8 by the kernel that wrote them (`given_rows`): (the rows, their bytes, their scales)
_given: tuple[weakref.ref[torch.Tensor], torch.Tensor, torch.Tensor] | None = None


def rows_to_fp8(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D fp32 `x` in fp8 over its own range (or over `amax`, ``[rows, 1]``: a whole row's of
    which `x` holds some columns): ``scale = max|row| / 448`` (``[rows, 1]``, at least fp32's smallest normal),
    ``q = x / scale`` clamped and rounded to ``float8_e4m3fn``."""
    amax = x.abs().amax(dim=1, keepdim=True) if amax is None else amax
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def applies(weight: torch.Tensor, device: torch.device) -> bool:
    """Whether this product can serve the fp8 `weight` ``[N, K]`` on `device` (module doc)."""
    outputs, inputs = weight.shape
    fits = weight.dtype == torch.float8_e4m3fn and outputs % PAD == 0 and inputs % PAD == 0
    return triton is not None and fp8_devices.native(device) and fits


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from lmiserve.engine.model.fp8_w8a8_kernel import quantize_rows_kernel, scale_rows_kernel

    return triton.jit(quantize_rows_kernel), triton.jit(scale_rows_kernel)


_ones: dict[torch.device, torch.Tensor] = {}  # the unit scales a device's products pass cuBLAS


def one_scale(scales: torch.Tensor) -> bool:
    """Whether per-channel `scales` ``[N]`` are all one value (a per-tensor weight's, expanded at load, or a fused
    linear's whose parts were put on one scale: `quant_formats.one_scale_for`). Read once a tensor (a host sync)
    and remembered while it lives; inside a CUDA-graph capture a tensor not yet read counts as not (nothing is read
    there: the eager warm-up before each capture reads them)."""
    if scales.dim() != 1:
        return False
    seen = _one_scale.get(id(scales))
    if seen is not None and seen[0]() is scales:
        return seen[1]
    if scales.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    same = bool((scales == scales[:1]).all())
    if len(_one_scale) > 4096:  # the scales of dropped models
        for key in [k for k, (ref, _) in _one_scale.items() if ref() is None]:
            del _one_scale[key]
    _one_scale[id(scales)] = (weakref.ref(scales), same)
    return same


def row_buffers(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for `rows` rows of `width` in fp8, padded to a multiple of `PAD` rows (their bytes, uint8), and for
    their fp32 scales: what `_rows_in_fp8`'s kernel writes, and the kernels that give rows (`given_rows`)."""
    padded = -(-rows // PAD) * PAD
    q = torch.empty(padded, width, dtype=torch.uint8, device=device)
    return q, torch.empty(padded, dtype=torch.float32, device=device)


def given_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """`x`'s rows in fp8 (`q`, ``float8_e4m3fn`` padded to `PAD` rows) and their `scales`, as `_rows_in_fp8` makes
    them, written by the kernel that wrote `x` (`fused_norm.add_rms_norm`, `fused_norm.silu_mul`): the products of
    `x` (the same tensor, never written in place) take them instead of a kernel of their own. One at a time: each
    replaces the last."""
    global _given
    _given = (weakref.ref(x), q, scales)


def _rows_in_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`'s rows in fp8, padded with zero rows to a multiple of `PAD`, and each row's scale (fp32, as padded), by
    `fp8_w8a8_kernel.quantize_rows_kernel` (one kernel), or as given (`given_rows`)."""
    given = _given
    if given is not None and given[0]() is x:
        return given[1], given[2]
    if triton is None:
        raise RuntimeError("the fp8 activations' kernels need triton")
    xq, x_scales = row_buffers(x.shape[0], x.shape[1], x.device)
    quantize_rows(x, xq, x_scales)
    return xq.view(torch.float8_e4m3fn), x_scales


def quantize_rows(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, int8: bool = False) -> None:
    """`x`'s rows ``[M, K]`` (contiguous rows) written into `q` ``[padded, K]`` and their `scales` ``[padded]``, each
    over its own range, the rows from M on zeros: e4m3's bytes, or int8 codes (`int8`: `int8_w8a8`), in one kernel
    (`fp8_w8a8_kernel.quantize_rows_kernel`)."""
    quantize, _ = _kernels()
    rows, inputs = x.shape
    block = triton.next_power_of_2(inputs)
    warps = min(16, max(4, block // 1024))  # 4-16 fp32 a thread
    quantize[(q.shape[0],)](x, q, scales, rows, inputs, x.stride(0), BLOCK_K=block, INT8=int8, num_warps=warps)


def scaled_rows(
    sums: torch.Tensor, x_scales: torch.Tensor, scales: torch.Tensor, rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """The first `rows` rows of cuBLAS's unscaled `sums` (fp32, or int32: `int8_w8a8`), each times its row's scale
    (`x_scales`) and its channel's (`scales` ``[N]``), in `dtype` (one kernel, `fp8_w8a8_kernel.scale_rows_kernel`)."""
    _, scale = _kernels()
    outputs = sums.shape[1]
    y = torch.empty(rows, outputs, dtype=dtype, device=sums.device)
    grid = (rows, triton.cdiv(outputs, BLOCK_N))
    scale[grid](sums, x_scales, scales, y, outputs, sums.stride(0), y.stride(0), BLOCK_N=BLOCK_N)
    return y


def product_one_scale(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`product` of one row `x` ``[1, K]`` and a weight whose `scales` ``[N]`` are one value (`one_scale`): the row in
    fp8 over its range, then one ``torch._scaled_mm`` with the row's scale and the weight's, in `x`'s dtype."""
    if x.shape[0] != 1:
        raise ValueError(f"product_one_scale takes one row, not {x.shape[0]}")
    xq, x_scales = _rows_in_fp8(x.contiguous())
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scales[:1], scale_b=scales[:1], out_dtype=x.dtype)
    return y[:1]


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x @ weight.T) * scales`` in `x`'s dtype for a 2-D `x` ``[M, K]``, a contiguous ``float8_e4m3fn``
    `weight` ``[N, K]`` and fp32 `scales` ``[N]``, `x` quantized to fp8 per row (module doc)."""
    x = x.contiguous()
    xq8, x_scales = _rows_in_fp8(x)
    one = _ones.get(x.device)
    if one is None:
        one = _ones[x.device] = torch.ones((), dtype=torch.float32, device=x.device)
    sums = torch._scaled_mm(xq8, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return scaled_rows(sums, x_scales, scales, x.shape[0], x.dtype)
