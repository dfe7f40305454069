"""W8A8's int8 activations (issue #39): the rows of a product quantized to int8 for cuBLAS's int8 x int8 product
(``torch._int_mm``), one of the products `fp8_gemv.choose` measures for the int8 codes a W8A8 checkpoint keeps on a
GPU (`int8_weights.Int8Scales.int8_rows`; compressed-tensors' ``int-quantized`` with 8-bit integer
``input_activations``, RedHatAI's ``quantized.w8a8`` releases).

Why: such a checkpoint was made for int8 activations (vLLM quantizes each token's row at every product and runs
the integer product on the tensor cores). Kept codes ran only `fp8_gemv`'s weight-only kernel, which read fp8
weights at 1.2-2.8 TB/s on an H200 where bf16's products read 3.3-4.2 (2026-12-04); cuBLAS's int8 product reads the
codes as cuBLAS reads bf16, and for many rows (prompts) the tensor cores' int8 rate is twice bf16's.

A product is three kernels, two of them `fp8_w8a8`'s: `fp8_w8a8.quantize_rows` (``int8``) quantizes each row over
its own range (``scale = max|row| / 127``, codes rounded to nearest even, clamped to +-127: the numbers of
`rows_to_int8`), the rows padded with zeros to more than 16 and to a multiple of 8 (`padded_rows`:
``torch._int_mm``'s bounds on CUDA); ``torch._int_mm`` sums in int32, exactly; `fp8_w8a8.scaled_rows` multiplies
each sum by its row's and its channel's scale and casts. Weights by channel only (W8A8's), both dimensions
multiples of 8 (`applies`). It competes as any candidate: checked against the same arithmetic in fp32 and timed
beside the weight-only tiles and the de-quantized product, so the rows go to int8 only where that is faster; each
candidate is within `kernel_choice.TOLERANCE` of the product it stands for. Not yet measured on a GPU (the GPU check's
`quantized` step times it: `int8_w8a8` in its kernel table).
"""

from __future__ import annotations

import torch

from lmiserve.engine.model import fp8_w8a8

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

__all__ = ["INT8_MAX", "INT8_ROWS", "RowsInInt8", "applies", "padded_rows", "product", "rows_to_int8"]

INT8_MAX = 127.0
MIN_ROWS = 17  # ``torch._int_mm`` on CUDA: more than 16 rows
MULTIPLE = 8  # ... and every other dimension a multiple of 8


class RowsInInt8:
    """The candidate product of this module, beside `fp8_gemv`'s tiles (one instance: `INT8_ROWS`)."""

    def __str__(self) -> str:
        return "cuBLAS int8 x int8, activations per row"

    __repr__ = __str__

    def run(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The product (`product`)."""
        return product(x, weight, scales)

    def quantized(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 `rows` as the product takes them (`rows_to_int8`), back in fp32 (`kernel_choice.pick` checks it)."""
        q, scales = rows_to_int8(rows)
        return q.float() * scales


INT8_ROWS = RowsInInt8()


def rows_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of a 2-D fp32 `x` in int8 over its own range: ``scale = max|row| / 127`` (``[rows, 1]``, at least
    fp32's smallest normal), ``q = x / scale`` clamped to +-127 and rounded to nearest, ties to even."""
    scale = (x.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round((x / scale).clamp(-INT8_MAX, INT8_MAX)).to(torch.int8), scale


def applies(weight: torch.Tensor, scales: torch.Tensor, device: torch.device) -> bool:
    """Whether this product can serve the int8 codes `weight` ``[N, K]`` with `scales` on `device`: a scale a
    channel, both dimensions multiples of 8, on CUDA with compute capability 8.0 or more (or a CPU, where the
    tests run the kernels under Triton's interpreter and torch has its own ``_int_mm``)."""
    outputs, inputs = weight.shape
    fits = weight.dtype == torch.int8 and scales.dim() == 1 and outputs % MULTIPLE == 0 and inputs % MULTIPLE == 0
    if triton is None or not fits:
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0))


def padded_rows(rows: int) -> int:
    """The rows the product runs with `rows` rows: at least `MIN_ROWS`, a multiple of `MULTIPLE` (zero rows added)."""
    return max(-(-MIN_ROWS // MULTIPLE), -(-rows // MULTIPLE)) * MULTIPLE


def product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x @ weight.T) * scales`` in `x`'s dtype for a 2-D `x` ``[M, K]``, contiguous int8 codes `weight` ``[N, K]``
    and fp32 `scales` ``[N]``, `x` quantized to int8 per row (module doc)."""
    if triton is None:
        raise RuntimeError("the int8 activations' kernels need triton")
    x = x.contiguous()
    rows, inputs = x.shape
    xq = torch.empty(padded_rows(rows), inputs, dtype=torch.int8, device=x.device)
    x_scales = torch.empty(xq.shape[0], dtype=torch.float32, device=x.device)
    fp8_w8a8.quantize_rows(x, xq, x_scales, int8=True)
    return fp8_w8a8.scaled_rows(torch._int_mm(xq, weight.t()), x_scales, scales, rows, x.dtype)
