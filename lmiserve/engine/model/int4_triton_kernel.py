"""The Triton kernel of `int4_triton` (imported only where Triton is installed; the interpreter runs it on a
CPU in the tests): ``y = x @ W.T`` for a 4-bit AWQ/GPTQ weight ``W[n, k] = (code - zero[g, n]) * scale[g,
n]`` with groups of `GROUP` consecutive inputs, the codes read once as int32 words and unpacked in
registers (no de-quantized copy of the weight anywhere)."""

import triton.language as tl

from lmiserve.engine.model.split_k_kernel import store_sums

__all__ = ["int4_gemm_kernel"]


def int4_gemm_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    o_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_s,
    k_split,
    p_ptr,
    c_ptr,
    stride_ps,
    GROUP: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # one program: BLOCK_N outputs of BLOCK_M rows over `k_split` of K (a multiple of BLOCK_K; all of K unsplit;
    # split: its fp32 sums to its slice of a [splits, M, N] `parts`, `stride_ps` apart, added in a fixed order by
    # the caller or the tile's last program: `store_sums`, as in `fp8_gemv_kernel`). The codes are [N, K / 8]
    # int32 words (nibble j of word r: input 8r + j), so a tile is BLOCK_N runs of BLOCK_K / 2 bytes. GROUP is a
    # multiple of BLOCK_K: a tile's inputs share one group, whose scale and zero are applied once to its sums,
    #   sum_k x_k (code_k - zero) scale = scale (sum_k x_k code_k - zero sum_k x_k).
    # HAS_ORDER (GPTQ's act-order): input k of the stored codes is column order[k] of x.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    shifts = (offs_k % 8) * 4
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    q_rows = q_ptr + offs_n[:, None].to(tl.int64) * (K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = pid_k * k_split
    for k0 in range(k_first, tl.minimum(K, k_first + k_split), BLOCK_K):
        k = k0 + offs_k
        if HAS_ORDER:
            k = tl.load(o_ptr + k)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        words = tl.load(q_rows + (k0 // 8 + offs_w)[None, :], mask=n_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K/8]
        # each word repeated 8 times along K (vLLM's Triton AWQ kernel unpacks so), then nibble k % 8 of each
        spread = tl.interleave(words, words)
        spread = tl.interleave(spread, spread)
        spread = tl.interleave(spread, spread)
        codes = (spread >> shifts[None, :]) & 0xF  # [BLOCK_N, BLOCK_K]
        if USE_DOT:  # 16 rows or more a tile: the tensor cores, codes 0..15 exact in the activations' dtype
            sums = tl.dot(x, tl.trans(codes.to(x.dtype)))
        else:  # 1 to 4 rows: products and a sum per row in fp32
            sums = tl.sum(x.to(tl.float32)[:, None, :] * codes.to(tl.float32)[None, :, :], axis=2)
        group = k0 // GROUP
        scale = tl.load(s_ptr + group * stride_s + offs_n, mask=n_ok, other=0.0)
        zero = tl.load(z_ptr + group * stride_s + offs_n, mask=n_ok, other=0.0)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += (sums - x_sum[:, None] * zero[None, :]) * scale[None, :]
    store_sums(acc, y_ptr, p_ptr, c_ptr, offs_m, offs_n, m_ok[:, None] & n_ok[None, :], stride_ym, stride_ps, SPLIT)
