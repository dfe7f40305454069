"""The Triton kernel of `int4_triton` (imported only where Triton is installed; the interpreter patches
this module's ``tl`` when it runs the kernel on a CPU). Run on an H200: correct, slow (`int4_triton`'s doc)."""

import triton.language as tl

__all__ = ["int4_matmul_kernel"]


def int4_matmul_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # GROUP > 0: the inputs' groups are contiguous runs of GROUP (a multiple of BLOCK_K), so a tile's scales
    # and zeros are one row of each; GROUP == 0: any `g_idx`, a scale and a zero gathered per input
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0
        )
        wmask = k_ok[:, None] & (offs_n[None, :] < N)
        words = tl.load(q_ptr + (k // 8)[:, None] * N + offs_n[None, :], mask=wmask, other=0)
        codes = (words >> ((k % 8) * 4)[:, None]) & 0xF
        if GROUP > 0:
            group = k0 // GROUP
            scale = tl.load(s_ptr + group * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + group * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            w = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]  # [BLOCK_K, BLOCK_N]
        else:
            g = tl.load(g_ptr + k, mask=k_ok, other=0)
            scale = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=wmask, other=0.0).to(tl.float32)
            w = (codes.to(tl.float32) - zero) * scale  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype))  # bf16/fp16 x: tensor cores; fp32 accumulation
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )
