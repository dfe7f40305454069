"""The Triton kernel of `triton_ops` (imported only where Triton is installed; the interpreter
patches this module's ``tl`` when it runs the kernel on a CPU).

A cache of another type than the queries' (`KV_CAST`: fp8, or bf16 under fp32 queries) is cast to theirs as it is
loaded. An fp8 cache on a GPU that converts fp8 itself is read through Triton's fp8 types; on one that does not
(an A100 or A10G, `KV_WIDEN`) the caches come as bytes, widened by moving their bits into a fp16
(`engine/fp8_widen.py`: e5m2 exactly, e4m3 as ``x / 2**8``, the 2**8 in the scales the caller passes), as the fp8
weights' kernel widens them.

`FP8_ROWS` (a decode graph's plan, a tile a row): the program of a row that finishes last (a ticket a row, taken
atomically) also writes the row's output in fp8 over its own range, with its scale (`row_to_e4m3`, as `fp8_w8a8`'s
quantizing kernel makes it from the stored row), for the o product (`fused_norm.attend`)."""

import triton.language as tl

from lmiserve.engine.fp8_widen import e4m3_over_256, e5m2
from lmiserve.engine.model.fp8_w8a8_kernel import row_to_e4m3

__all__ = ["paged_attention_kernel"]


def paged_attention_kernel(  # pragma: no cover - runs as a Triton kernel
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tile_seq_ptr,
    tile_first_ptr,
    tile_count_ptr,
    pos_ptr,
    table_ptr,
    scale,
    v_scale,
    window,
    softcap,
    sinks_ptr,
    rows_q_ptr,
    rows_s_ptr,
    done_ptr,
    ROW_WIDTH,
    ROWS_PADDED,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ko,
    stride_ot,
    stride_oh,
    stride_table,
    GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_CAST: tl.constexpr,
    KV_WIDEN: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    ZERO_EMPTY: tl.constexpr,
    FP8_ROWS: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    # ZERO_EMPTY: every token is the first of a tile of its own (a decode graph's plan), `out` is not zeroed
    # beforehand, and a tile of no token (a padding row) writes its row's zeros itself
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    count = tl.load(tile_count_ptr + tile)
    if count > 0:
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        rows = tl.arange(0, BLOCK_Q * GROUPS_PAD)
        token = rows // GROUPS_PAD
        group = rows % GROUPS_PAD
        valid = (token < count) & (group < GROUPS)
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_DIM
        head = kv_head * GROUPS + group
        q_at = q_ptr + (first + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_at, mask=valid[:, None] & dim_ok[None, :], other=0.0)
        last = tl.load(pos_ptr + first + count - 1)
        # a padding row sees what the tile's last token sees (finite; never stored)
        pos = tl.load(pos_ptr + first + token, mask=token < count, other=0)
        pos = tl.where(token < count, pos, last)
        if SINKS:  # gpt-oss's: one more logit a head, taking probability but no value (exp(sink - m) in l)
            m_i = tl.load(sinks_ptr + head, mask=group < GROUPS, other=0.0).to(tl.float32)
            l_i = tl.full([BLOCK_Q * GROUPS_PAD], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_Q * GROUPS_PAD], float("-inf"), dtype=tl.float32)
            l_i = tl.full([BLOCK_Q * GROUPS_PAD], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_Q * GROUPS_PAD, HEAD_PAD], 0.0, dtype=tl.float32)
        table = table_ptr + seq * stride_table
        # a sliding window (window > 0): each query sees positions (pos - window, pos]; the loop starts at the
        # BLOCK_N tile of the tile's first token's first position
        lowest = tl.load(pos_ptr + first) - window + 1
        begin = tl.where(window > 0, tl.maximum(lowest, 0), 0) // BLOCK_N * BLOCK_N
        floor = tl.where(window > 0, pos - window, -1)
        for start in range(begin, last + 1, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            seen = offs <= last
            block = tl.load(table + offs // BLOCK_SIZE, mask=seen, other=0).to(tl.int64)
            at = block * stride_kb + kv_head * stride_kh + (offs % BLOCK_SIZE) * stride_ko
            kv_mask = seen[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if KV_WIDEN == 1:  # e4m3 bytes: k / 2**8 in a fp16
                k = e4m3_over_256(k)
            elif KV_WIDEN == 2:  # e5m2 bytes: a fp16's high byte
                k = e5m2(k)
            if KV_CAST:  # fp8, or bf16 under fp32 queries: cast to the queries' dtype (a key scale is in `scale`)
                k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:  # Gemma 2's scores soft-capped: c * tanh(s / c), tanh(x) = 2 * sigmoid(2x) - 1
                scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
            scores = tl.where((offs[None, :] <= pos[:, None]) & (offs[None, :] > floor[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # a row that has seen no position yet (before its window) keeps m = -inf: subtract 0 instead
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if KV_WIDEN == 1:
                v = e4m3_over_256(v)
            elif KV_WIDEN == 2:
                v = e5m2(v)
            if KV_CAST:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        if KV_CAST:  # an fp8 cache's value scale (1.0 for bf16, and not applied where the cache is the queries' type)
            out = out * v_scale
        o_at = out_ptr + (first + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dim_ok[None, :])
    elif ZERO_EMPTY:
        first = tl.load(tile_first_ptr + tile)
        group = tl.arange(0, GROUPS_PAD)
        dims = tl.arange(0, HEAD_PAD)
        head = kv_head * GROUPS + group
        o_at = out_ptr + first * stride_ot + head[:, None] * stride_oh + dims[None, :]
        zeros = tl.zeros([GROUPS_PAD, HEAD_PAD], dtype=out_ptr.dtype.element_ty)
        tl.store(o_at, zeros, mask=(group < GROUPS)[:, None] & (dims < HEAD_DIM)[None, :])
    if FP8_ROWS:  # (`out` contiguous; `done`: a zero a row, left zero)
        row = tl.load(tile_first_ptr + tile)
        # a ticket, as `split_k_kernel.store_sums` takes one (CUTLASS's serial split-K semaphore): every thread's
        # part of the row stored before the ticket releases them; the last ticket's program reads them all
        tl.debug_barrier()
        finished = tl.atomic_add(done_ptr + row, 1, sem="acq_rel", scope="gpu")
        if finished == tl.num_programs(1) - 1:
            cols = tl.arange(0, ROW_PAD)
            within = cols < ROW_WIDTH
            x = tl.load(out_ptr + row * stride_ot + cols, mask=within, other=0.0, cache_modifier=".cg")
            q8, row_scale = row_to_e4m3(x.to(tl.float32))
            tl.store(rows_q_ptr + row * ROW_WIDTH + cols, q8, mask=within)
            tl.store(rows_s_ptr + row, row_scale)
            tl.atomic_xchg(done_ptr + row, 0, sem="relaxed", scope="gpu")  # (for the next launch)
            if row == tl.num_programs(0) - 1:  # the padding rows past the last: zeros (as the quantizing kernel's)
                for pad in range(tl.num_programs(0), ROWS_PADDED):
                    tl.store(rows_q_ptr + pad * ROW_WIDTH + cols, tl.zeros([ROW_PAD], dtype=tl.uint8), mask=within)
                    tl.store(rows_s_ptr + pad, 1.1754943508222875e-38)
