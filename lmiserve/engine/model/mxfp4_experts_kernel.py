"""The Triton kernel of `mxfp4_experts` (imported only where Triton is installed; the interpreter runs it on a CPU in
the tests): gpt-oss's grouped product with its MXFP4 experts, ``y[r] = x[r] @ W[e].T`` for the rows `r` routed to
expert `e`, ``W[e][n, k] = fp4(code) * 2 ** (scale[n, k // 32] - 127)``: each expert's bytes (two 4-bit floats each,
the low nibble first) read once a tile of rows and turned into values in registers (no de-quantized copy).

The rows come sorted by expert, cut into tiles of `BLOCK_M` of one expert (`grouped_experts.row_tiles`, as
`fp8_experts_kernel`'s). A 4-bit float (e2m1) is a sign, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3,
4, 6 and their negatives. `BLOCK_K` is a multiple of 32 (a block of the format); each block's power of two is applied
to its values before the product, exactly (a 4-bit float times a power of two is a bf16 or fp16 value)."""

import triton.language as tl

__all__ = ["mxfp4_experts_kernel"]


def mxfp4_experts_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    tile_expert_ptr,
    tile_first_ptr,
    tile_end_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_be,
    stride_se,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program: BLOCK_N outputs of one tile of rows (all routed to one expert) over all of K. An expert's bytes
    # are [N, K / 2] (byte j of row n: inputs 2j and 2j + 1, low nibble first), its scales [N, K / 32] (uint8)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = tl.load(tile_first_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    if first < end:
        expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
        offs_m = first + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_s = tl.arange(0, BLOCK_K // 32)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < end
        n_ok = offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        b_rows = b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * (K // 2)
        s_rows = s_ptr + expert * stride_se + offs_n[:, None].to(tl.int64) * (K // 32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            packed = tl.load(b_rows + (k0 // 2 + offs_b)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K]: input 2j, then 2j + 1
            exponent = (codes >> 1) & 3
            mantissa = (codes & 1).to(tl.float32)
            normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
            value = tl.where(exponent == 0, 0.5 * mantissa, normal)
            value = tl.where((codes & 8) != 0, -value, value)
            powers = tl.load(s_rows + (k0 // 32 + offs_s)[None, :], mask=n_ok[:, None], other=127)
            scale = tl.exp2(powers.to(tl.float32) - 127.0)  # [BLOCK_N, BLOCK_K / 32]
            w = tl.reshape(tl.reshape(value, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        mask = m_ok[:, None] & n_ok[None, :]
        y_at = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=mask)
