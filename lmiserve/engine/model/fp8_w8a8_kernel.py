"""The Triton kernels of `fp8_w8a8` and `int8_w8a8` (imported only where Triton is installed; the interpreter runs
them on a CPU in the tests): a few rows of activations to fp8 (or to int8: ``INT8``), each over its own range, in one
kernel; and the product's scales (a row's and an output channel's) applied to cuBLAS's unscaled fp32 (or int32)
sums, with the cast, in one more. `row_to_e4m3` is the fp8 quantization itself, which `fused_norm_kernel`'s RMS
norm also runs on the row it writes; `row_to_int8` the int8 one."""

import triton
import triton.language as tl

__all__ = ["e4m3_bytes", "quantize_rows_kernel", "row_to_e4m3", "row_to_int8", "scale_rows_kernel"]


def quantize_rows_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    INT8: tl.constexpr = False,
):
    # one program a row of the padded [grid, K] `q` (rows from M on: zeros): the whole row in registers
    # (BLOCK_K >= K); e4m3's bytes, or with INT8 int8 codes
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    k_ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=k_ok & (row < M), other=0.0).to(tl.float32)
    if INT8:
        q, scale = row_to_int8(x)
    else:
        q, scale = row_to_e4m3(x)
    tl.store(q_ptr + row * K + offs, q, mask=k_ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def row_to_int8(x):  # pragma: no cover - in the kernels
    # a row `x` (fp32, its masked columns 0) as int8 codes over its own range: scale = max |x| / 127 (at least fp32's
    # smallest normal, as `int8_w8a8.rows_to_int8`), x / scale clamped to +-127 and rounded to nearest, ties to even
    # (fp32's own rounding: adding and taking away 1.5 * 2**23 leaves an integer for any |v| < 2**22)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 127.0, 1.1754943508222875e-38)
    v = tl.minimum(tl.maximum(x / scale, -127.0), 127.0)
    return ((v + 12582912.0) - 12582912.0).to(tl.int8), scale


@triton.jit
def row_to_e4m3(x):  # pragma: no cover - in the kernels
    # a row `x` (fp32, its masked columns 0) as e4m3's bytes over its own range: its max |x|, scale = max / 448 (at
    # least fp32's smallest normal, as `rows_to_fp8`), x / scale in e4m3 (`e4m3_bytes`); (the bytes, the scale)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.1754943508222875e-38)
    return e4m3_bytes(x / scale), scale


@triton.jit
def e4m3_bytes(x):  # pragma: no cover - in the kernels
    # fp32 `x` as e4m3's bytes (``float8_e4m3fn``), clamped to +-448 and rounded to nearest with ties to even, the
    # bits put together with integer ops alone (no fp8 conversion: any GPU, an A100 too, where Triton has no
    # ``float8e4nv``): torch's ``.to(float8_e4m3fn)`` of the clamped values, bit for bit (-0, and a negative value
    # that rounds to zero: -0)
    v = tl.minimum(tl.maximum(x, -448.0), 448.0)
    a = tl.abs(v)
    bits = a.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # 3 mantissa bits (a carry: the exponent)
    normal = ((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)).to(tl.int32)  # exponent - 127 + 7
    subnormal = (((a + 24576.0) - 24576.0) * 512.0).to(tl.int32)  # multiples of 2**-9 (8 of them: 2**-6, normal)
    code = tl.where(a < 0.015625, subnormal, normal)
    return (code | ((v.to(tl.uint32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


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
    # y[m, n] = acc[m, n] * row_scale[m] * channel_scale[n], in y's dtype: one program BLOCK_N outputs of a row;
    # `acc` fp32 (cuBLAS's fp8 sums) or int32 (its int8 sums, `int8_w8a8`)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs < N
    acc = tl.load(acc_ptr + row * stride_am + offs, mask=n_ok, other=0).to(tl.float32)
    channel = tl.load(ws_ptr + offs, mask=n_ok, other=0.0)
    y = acc * tl.load(xs_ptr + row) * channel
    tl.store(y_ptr + row * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=n_ok)
