"""The Triton kernels of `fused_norm` (imported only where Triton is installed; the interpreter patches this
module's ``tl`` when it runs them on a CPU)."""

import triton
import triton.language as tl

from lmiserve.engine.model.fp8_w8a8_kernel import e4m3_bytes, row_to_e4m3

__all__ = ["add_rms_norm_kernel", "head_normed", "rope_store_kernel", "rotated", "silu_mul_kernel"]


def add_rms_norm_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    r_ptr,
    w_ptr,
    out_x_ptr,
    h_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program a row; QUANT: also the normed row in fp8 over its own range (`row_to_e4m3`, as `fp8_w8a8`'s
    # quantizing kernel makes it from the stored row) with its scale, the grid padded past the M rows (zeros)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = (cols < N) & (row < M)
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:  # the residual add, rounded to the model's dtype as `x + o` is
        r = tl.load(r_ptr + row * N + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_x_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    h = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)).to(dtype)  # transformers' LlamaRMSNorm
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = (w.to(tl.float32) * h.to(tl.float32)).to(dtype)
    tl.store(h_ptr + row * N + cols, normed, mask=mask)
    if QUANT:
        q, scale = row_to_e4m3(normed.to(tl.float32))
        tl.store(q_ptr + row * N + cols, q, mask=cols < N)
        tl.store(s_ptr + row, scale)


def silu_mul_kernel(  # pragma: no cover - runs as a Triton kernel
    g_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    M,
    INTER,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # QUANT: one program a whole row (BLOCK >= INTER), also written in fp8 over its own range with its scale, as
    # `add_rms_norm_kernel`'s (the grid padded past the M rows: zeros)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < INTER) & (row < M)
    a = tl.load(g_ptr + row * 2 * INTER + cols, mask=mask, other=0.0)
    b = tl.load(g_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0)
    af = a.to(tl.float32)
    s = (af / (1.0 + tl.exp(-af))).to(b.dtype)  # SiLU in the model's dtype, as `act(gate)` rounds it
    out = (s.to(tl.float32) * b.to(tl.float32)).to(b.dtype)
    tl.store(out_ptr + row * INTER + cols, out, mask=mask)
    if QUANT:
        q, scale = row_to_e4m3(out.to(tl.float32))
        tl.store(q_ptr + row * INTER + cols, q, mask=cols < INTER)
        tl.store(s_ptr + row, scale)


def rope_store_kernel(  # pragma: no cover - runs as a Triton kernel
    x_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    write_ptr,
    w_ptr,
    eps,
    k_scale,
    v_scale,
    ROW,
    HEADS,
    KV_HEADS,
    WRITTEN,
    D,
    HALF,
    FP8: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program a (token, head) of q's, k's and v's heads: q's and k's (HEAD_NORM: first each normed over its
    # head_dim with its row of `w`, `eps`, as `layer_ops.rms_norm` norms them) rotated (`rotated`), q's written to
    # `q` ([tokens, HEADS, D]), k's and v's (the first WRITTEN tokens') stored in the cache's rows (`write`: a row
    # of the flat cache a (token, kv head)), in fp8 (FP8: e4m3's bytes, the cache as uint8, made with integer ops:
    # any GPU) as `kv_quant.store` stores them (over the layer's scale, clamped, rounded to nearest), else cast to
    # its dtype. The rotation alone (`fused_norm.rope`): KV_HEADS 0 and WRITTEN 0, all the rotated heads as q's
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = x_ptr + token * ROW + head * D
    first, second = tl.load(base + cols, mask=mask, other=0.0), tl.load(base + HALF + cols, mask=mask, other=0.0)
    if head < HEADS + KV_HEADS:
        if HEAD_NORM:  # (Qwen3's norm of each q and k head, before the rotation)
            first, second = head_normed(first, second, w_ptr + head * D, eps, cols, mask, HALF)
        first, second = rotated(first, second, cos_ptr + token * D, sin_ptr + token * D, cols, mask, HALF)
    if head < HEADS:
        out = q_ptr + (token * HEADS + head) * D
        tl.store(out + cols, first, mask=mask)
        tl.store(out + HALF + cols, second, mask=mask)
    elif token < WRITTEN:
        value = head >= HEADS + KV_HEADS
        cache = tl.where(value, v_ptr, k_ptr)
        kv_head = tl.where(value, head - HEADS - KV_HEADS, head - HEADS)
        row = tl.load(write_ptr + token * KV_HEADS + kv_head)
        out = cache + row * D
        if FP8:
            scale = tl.where(value, v_scale, k_scale)
            # (divided as torch divides: rounded to nearest, never an approximate division)
            tl.store(out + cols, e4m3_bytes(tl.math.div_rn(first.to(tl.float32), scale)), mask=mask)
            tl.store(out + HALF + cols, e4m3_bytes(tl.math.div_rn(second.to(tl.float32), scale)), mask=mask)
        else:
            tl.store(out + cols, first.to(out.dtype.element_ty), mask=mask)
            tl.store(out + HALF + cols, second.to(out.dtype.element_ty), mask=mask)


@triton.jit
def head_normed(x1, x2, w_row, eps, cols, mask, HALF):  # pragma: no cover - in the kernels
    # transformers' RMS norm of a head given as its two halves (the model's dtype; masked columns 0): fp32
    # statistics, the normed head rounded to the model's dtype, then times the weight's row (the model's dtype)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF) + eps)
    w1 = tl.load(w_row + cols, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    return (w1 * (a * r).to(dtype).to(tl.float32)).to(dtype), (w2 * (b * r).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def rotated(x1, x2, cos_row, sin_row, cols, mask, HALF):  # pragma: no cover - in the kernels
    # a head's two halves `x1`, `x2` rotated by its token's `cos` and signed `sin` rows: ``x * cos +
    # rotate_half(x) * signed_sin`` with each product and the sum rounded to the model's dtype, as the eager ops
    # round them; (the first half, the second), in the model's dtype
    dtype = x1.dtype
    c1 = tl.load(cos_row + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    first = (a * c1).to(dtype).to(tl.float32) + (b * s1).to(dtype).to(tl.float32)
    second = (b * c2).to(dtype).to(tl.float32) + (a * s2).to(dtype).to(tl.float32)
    return first.to(dtype), second.to(dtype)
