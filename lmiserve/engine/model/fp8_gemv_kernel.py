"""The Triton kernel of `fp8_gemv` (imported only where Triton is installed; the interpreter runs it on a
CPU in the tests): ``y = (x @ W.T) * scale`` for the rows of `x`, the fp8 weight read once, as bytes, and
widened in registers (no activation quantization, no bf16 copy of the weight).

Widened by the GPU's fp8 conversion where it has one (`NATIVE`: compute capability 8.9 or more), else by moving
the bits: an e4m3 byte's sign, 4 exponent bits and 3 mantissa bits placed in a fp16's sign and the low 4 of its
5 exponent bits and top 3 mantissa bits read as ``w / 2**8`` (the biases differ by 15 - 7 = 8), exactly,
subnormals included (as Marlin's fp8 kernels do on Ampere); the 2**8 goes into the scale. e4m3fn's NaN
(``0x7f``) would read as a number, and checkpoints hold none."""

import triton.language as tl

__all__ = ["fp8_gemv_kernel"]


def fp8_gemv_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N outputs of BLOCK_M rows over the whole of K; the weight's rows are K-contiguous,
    # so a [BLOCK_N, BLOCK_K] tile is BLOCK_N runs of BLOCK_K bytes
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            bits = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0)
        else:
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            bits = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if NATIVE:
            w = bits.to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, BLOCK_K]; bits 0 are +0.0
        else:
            h = bits.to(tl.uint16)
            w = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)  # w / 2**8, exactly
        if USE_DOT:  # 16 rows or more a tile: the tensor cores, in the activations' dtype
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:  # 1 to 4 rows: products and a sum per row in fp32, no operand shuffles
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    if not NATIVE:
        scale = scale * 256.0
    y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
