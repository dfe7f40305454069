"""A miscompiled fp8 kernel's stand-in for tests/unit/test_fp8_gemv.py: `fp8_gemv_kernel`'s loops with the
scale forgotten (no ``from __future__ import annotations`` here: Triton reads the constexpr annotations)."""

import triton.language as tl


def wrong_fp8_gemv_kernel(  # pragma: no cover - runs as a Triton kernel
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=(offs_m[:, None] < M) & ok[None, :], other=0.0
        )
        bits = tl.load(w_ptr + offs_n[:, None] * K + k[None, :], mask=(offs_n[:, None] < N) & ok[None, :], other=0)
        w = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
