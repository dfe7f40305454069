"""The Triton kernel of `fp8_experts` (imported only where Triton is installed; the interpreter runs it on a CPU
in the tests): a mixture of experts' grouped product with fp8 weights, ``y[r] = (x[r] @ W[e].T) * scale`` for the
rows `r` routed to expert `e`, each expert's weight ``[N, K]`` read once a tile of rows, as bytes, and widened in
registers (no bf16 copy of the experts).

The rows come sorted by expert; the caller cuts each expert's run of rows into tiles of `BLOCK_M` and gives each
tile its expert, first row and end (`grouped_experts.row_tiles`). A tile past the rows (the grid is sized for the most
tiles the rows could make, so a CUDA graph replays it at any routing) has first == end and loads nothing.

Scales per output channel (``[experts, N]``, applied to the sums), or by blocks of `GROUP` inputs (block-wise fp8:
``[experts, N, cdiv(K, GROUP)]``; `BLOCK_K` divides `GROUP`, so a tile's inputs lie in one block and its sums are
scaled before they are added). Widened by the GPU's fp8 conversion where it has one (`NATIVE`), else by moving the
bits (`engine/fp8_widen.py`: ``w / 2**8`` exactly; the 2**8 goes into the scale). 8-bit integer codes (`INT8`:
GPTQ's and compressed-tensors' int8 experts, `int8_experts`) are read the same way, each exact in the activations'
dtype."""

import triton.language as tl

from lmiserve.engine.fp8_widen import e4m3_over_256

__all__ = ["fp8_experts_kernel"]


def fp8_experts_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_first_ptr,
    tile_end_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_we,
    stride_se,
    stride_sn,
    EVEN_K: tl.constexpr,
    NATIVE: tl.constexpr,
    INT8: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N outputs of one tile of rows (all routed to one expert) over all of K; the expert's
    # weight rows are K-contiguous, so a [BLOCK_N, BLOCK_K] tile is BLOCK_N runs of BLOCK_K bytes
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = tl.load(tile_first_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    if first < end:
        expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < end
        n_ok = offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * K
        s_rows = s_ptr + expert * stride_se + offs_n * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            x_ok = m_ok[:, None]
            w_ok = n_ok[:, None]
            if not EVEN_K:
                x_ok = x_ok & (k < K)[None, :]
                w_ok = w_ok & (k < K)[None, :]
            x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
            bits = tl.load(w_rows + k[None, :], mask=w_ok, other=0)
            if INT8:  # 8-bit integer codes (`int8_experts`): each exact in the activations' dtype
                w = bits.to(tl.int8, bitcast=True)
            elif NATIVE:  # the fp8 type compiles only where the GPU has it
                w = bits.to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, BLOCK_K]; bits 0 are +0.0
            else:
                w = e4m3_over_256(bits)
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if GROUP > 0:  # the tile's inputs in one block: each output's scale of that block
                part = part * tl.load(s_rows + k0 // GROUP, mask=n_ok, other=0.0)[None, :]
            acc += part
        if GROUP > 0:  # noqa: SIM108 - a constexpr branch
            scale = tl.full((BLOCK_N,), 1.0, tl.float32)
        else:
            scale = tl.load(s_rows, mask=n_ok, other=0.0)
        if not NATIVE and not INT8:
            scale = scale * 256.0
        y = acc * scale[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(
            y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask
        )
