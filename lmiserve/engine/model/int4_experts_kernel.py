"""The Triton kernel of `int4_experts` (imported only where Triton is installed; the interpreter runs it on a CPU in
the tests): a mixture of experts' grouped product with AWQ's or GPTQ's 4-bit weights, ``y[r] = x[r] @ W[e].T`` for
the rows `r` routed to expert `e`, ``W[e][n, k] = (code - zero[g, n]) * scale[g, n]`` over groups of `GROUP`
consecutive inputs, each expert's codes read once a tile of rows as int32 words and unpacked in registers (no
de-quantized copy of the experts anywhere).

The rows come sorted by expert; the caller cuts each expert's run into tiles of `BLOCK_M` (`grouped_experts.row_tiles`,
as `fp8_experts_kernel`'s): a tile past the rows has first == end and loads nothing. `BLOCK_K` divides `GROUP`, so a
tile's inputs share one group, whose scale and zero are applied once to its sums (``scale * (sum x code - zero * sum
x)``, as `int4_triton_kernel` does). With `HAS_ORDER` (GPTQ's act-order) stored input k of expert e is the rows'
column ``order[e, k]``."""

import triton.language as tl

__all__ = ["int4_experts_kernel"]


def int4_experts_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    o_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_first_ptr,
    tile_end_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_qe,
    stride_se,
    GROUP: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N outputs of one tile of rows (all routed to one expert) over all of K. An expert's codes
    # are [N, K / 8] int32 words (nibble j of word r: input 8r + j), so a tile is BLOCK_N runs of BLOCK_K / 2 bytes;
    # its scales and zeros are [K / GROUP, N] (a group's row of outputs contiguous), fp32, zeros in steps
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = tl.load(tile_first_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    if first < end:
        expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_k = tl.arange(0, BLOCK_K)
        shifts = (offs_k % 8) * 4
        m_ok = offs_m < end
        n_ok = offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        q_rows = q_ptr + expert * stride_qe + offs_n[:, None].to(tl.int64) * (K // 8)
        s_first = expert * stride_se + offs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if HAS_ORDER:  # (GPTQ's act-order: stored input k is column order[e, k] of the rows)
                k = tl.load(o_ptr + expert * K + k)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            words = tl.load(q_rows + (k0 // 8 + offs_w)[None, :], mask=n_ok[:, None], other=0)
            # each word repeated 8 times along K, then nibble k % 8 of each (as `int4_triton_kernel` unpacks)
            spread = tl.interleave(words, words)
            spread = tl.interleave(spread, spread)
            spread = tl.interleave(spread, spread)
            codes = (spread >> shifts[None, :]) & 0xF  # [BLOCK_N, BLOCK_K], 0..15: exact in the rows' dtype
            sums = tl.dot(x, tl.trans(codes.to(x.dtype)))
            at = s_first + (k0 // GROUP) * N
            scale = tl.load(s_ptr + at, mask=n_ok, other=0.0)
            zero = tl.load(z_ptr + at, mask=n_ok, other=0.0)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            acc += (sums - x_sum[:, None] * zero[None, :]) * scale[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(
            y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=mask,
        )
