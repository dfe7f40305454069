"""The Triton kernels of `fp8_w8a8` (imported only where Triton is installed; the interpreter runs them on a CPU
in the tests): a few rows of activations to fp8, each over its own range, in one kernel; and the product's
scales (a row's and an output channel's) applied to cuBLAS's unscaled fp32 sums, with the cast, in one more.
`row_to_e4m3` is the quantization itself, which `fused_norm_kernel`'s RMS norm also runs on the row it writes."""

import triton
import triton.language as tl

__all__ = ["quantize_rows_kernel", "row_to_e4m3", "scale_rows_kernel", "to_e4m3"]


def quantize_rows_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
):
    # one program a row of the padded [grid, K] `q` (rows from M on: zeros): the whole row in registers
    # (BLOCK_K >= K)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    k_ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=k_ok & (row < M), other=0.0).to(tl.float32)
    q, scale = row_to_e4m3(x)
    tl.store(q_ptr + row * K + offs, q, mask=k_ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def row_to_e4m3(x):  # pragma: no cover - in the kernels
    # a row `x` (fp32, its masked columns 0) as e4m3's bytes over its own range: its max |x|, scale = max / 448 (at
    # least fp32's smallest normal, as `rows_to_fp8`), x / scale in e4m3 (`to_e4m3`); (the bytes, the scale)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.1754943508222875e-38)
    return to_e4m3(x / scale).to(tl.uint8, bitcast=True), scale


@triton.jit
def to_e4m3(x):  # pragma: no cover - in the kernels
    # fp32 `x` clamped to +-448 and rounded to e4m3's grid here, to nearest with ties to even, then cast (the cast
    # rounds nothing, on a GPU and in Triton's interpreter alike: torch's ``.to(float8_e4m3fn)`` of the clamped
    # values, bit for bit)
    v = tl.minimum(tl.maximum(x, -448.0), 448.0)
    # normal e4m3 (|v| >= 2**-6): fp32's 23 mantissa bits rounded to 3 (a carry moves into the exponent)
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal e4m3 (multiples of 2**-9): |v| added to 1.5 * 2**14, whose fp32 spacing is 2**-9, and taken off, then
    # v's sign (a negative value that rounds to zero is -0, as torch's cast gives it)
    subnormal = (tl.abs(v) + 24576.0) - 24576.0
    subnormal = tl.where(v < 0, -subnormal, subnormal)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal).to(tl.float8e4nv)


def scale_rows_kernel(  # pragma: no cover - runs as a Triton kernel
    acc_ptr,
    xs_ptr,
    ws_ptr,
    y_ptr,
    N,
    stride_am,
    stride_ym,
    BLOCK_N: tl.constexpr,
):
    # y[m, n] = acc[m, n] * row_scale[m] * channel_scale[n], in y's dtype: one program BLOCK_N outputs of a row
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs < N
    acc = tl.load(acc_ptr + row * stride_am + offs, mask=n_ok, other=0.0)
    channel = tl.load(ws_ptr + offs, mask=n_ok, other=0.0)
    y = acc * tl.load(xs_ptr + row) * channel
    tl.store(y_ptr + row * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=n_ok)
