"""The Triton kernel of `fp8_gemv` (imported only where Triton is installed; the interpreter runs it on a
CPU in the tests): ``y = (x @ W.T) * scale`` for the rows of `x`, the fp8 weight read once, as bytes, and
widened in registers (no activation quantization, no bf16 copy of the weight). 8-bit integer codes (`INT8`,
compressed-tensors' W8A8 and W8A16 checkpoints: `int8_weights`) are read the same way, each converted exactly.

Scales per output channel (``[N]``, applied to the sums), or by blocks of `GROUP` inputs (block-wise fp8: each
row's scales ``[N, cdiv(K, GROUP)]``, `stride_s` apart): where a tile's inputs lie in one block
(`SCALE_PER_TILE`: `GROUP` a multiple of `BLOCK_K`) its fp32 sums are scaled before they are added, else each
widened weight is scaled before the product (in fp32: the weight de-quantized in registers).

Widened by the GPU's fp8 conversion where it has one (`NATIVE`: compute capability 8.9 or more), else by moving
the bits (`engine/fp8_widen.py`: ``w / 2**8`` in a fp16, exactly; the 2**8 goes into the scale)."""

import triton
import triton.language as tl

from lmiserve.engine.fp8_widen import e4m3_over_256
from lmiserve.engine.model.split_k_kernel import store_sums

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
    k_split,
    p_ptr,
    c_ptr,
    stride_ps,
    stride_s,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    LATE_SUM: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # one program: BLOCK_N outputs of BLOCK_M rows over `k_split` of K (a multiple of BLOCK_K, or all of K); the
    # weight's rows are K-contiguous, so a [BLOCK_N, BLOCK_K] tile is BLOCK_N runs of BLOCK_K bytes. K split
    # between the grid's third axis: each program's scaled fp32 sums go to its slice of a [splits, M, N] `parts`
    # (`stride_ps` apart), added in a fixed order by the caller or by the tile's last program (`store_sums`,
    # SPLIT). LATE_SUM (per-row sums): the products kept [BLOCK_M, BLOCK_N, BLOCK_K] over the loop and summed
    # over K once at the end (no cross-lane reduction a step). PREFETCH: the next step's loads issued before this
    # step's arithmetic (two tiles of bytes in flight a program: Triton pipelines only the loads of its dots)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LATE_SUM:
        late = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = pid_k * k_split
    k_end = tl.minimum(K, k_first + k_split)
    if PREFETCH:
        x_next, bits_next = _tile(x_rows, w_rows, k_first + offs_k, m_ok, n_ok, K, k_first < k_end, EVEN_K)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + offs_k
        if PREFETCH:
            x = x_next
            bits = bits_next
            x_next, bits_next = _tile(x_rows, w_rows, k + BLOCK_K, m_ok, n_ok, K, k0 + BLOCK_K < k_end, EVEN_K)
        else:
            x, bits = _tile(x_rows, w_rows, k, m_ok, n_ok, K, True, EVEN_K)
        if INT8:  # 8-bit integer codes (`int8_weights`): each exact in the activations' dtype and in fp32
            w = bits.to(tl.int8, bitcast=True)
        elif NATIVE:  # the fp8 type compiles only where the GPU has it
            w = bits.to(tl.float8e4nv, bitcast=True)  # [BLOCK_N, BLOCK_K]; bits 0 are +0.0
        else:
            w = e4m3_over_256(bits)
        if GROUP > 0 and not SCALE_PER_TILE:  # blocks smaller than the tile: each weight times its block's scale
            block_scales = s_ptr + offs_n[:, None] * stride_s + (k // GROUP)[None, :]
            w = w.to(tl.float32) * tl.load(block_scales, mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if SCALE_PER_TILE:  # the tile's inputs in one block: each output's scale of that block
            tile_scales = tl.load(s_ptr + offs_n * stride_s + k0 // GROUP, mask=n_ok, other=0.0)
        if LATE_SUM:  # products kept per input (a tile in one block: its weights times the block's scales)
            if SCALE_PER_TILE:
                w = w.to(tl.float32) * tile_scales[:, None]
            late += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            if USE_DOT:  # 16 rows or more a tile: the tensor cores, in the activations' dtype
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            else:  # 1 to 4 rows: products and a sum per row in fp32, no operand shuffles
                part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            if SCALE_PER_TILE:  # the tile's sums times the block's scale of each output
                part = part * tile_scales[None, :]
            acc += part
    if LATE_SUM:
        acc = tl.sum(late, axis=2)
    if GROUP > 0:  # noqa: SIM108 - a constexpr branch
        scale = tl.full((BLOCK_N,), 1.0, tl.float32)
    else:
        scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    if not NATIVE and not INT8:
        scale = scale * 256.0
    mask = m_ok[:, None] & n_ok[None, :]
    store_sums(acc * scale[None, :], y_ptr, p_ptr, c_ptr, offs_m, offs_n, mask, stride_ym, stride_ps, SPLIT)


@triton.jit
def _tile(x_rows, w_rows, k, m_ok, n_ok, K, live, EVEN_K: tl.constexpr):  # pragma: no cover - in the kernel
    # the rows' activations [BLOCK_M, BLOCK_K] and the weight's bytes [BLOCK_N, BLOCK_K] at inputs `k`; none where
    # not `live` (a step past the program's share: its loads read nothing)
    x_ok = m_ok[:, None] & live
    w_ok = n_ok[:, None] & live
    if not EVEN_K:
        x_ok = x_ok & (k < K)[None, :]
        w_ok = w_ok & (k < K)[None, :]
    x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
    bits = tl.load(w_rows + k[None, :], mask=w_ok, other=0)
    return x, bits
