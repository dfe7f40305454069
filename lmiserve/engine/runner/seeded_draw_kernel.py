"""The Triton kernel of `seeded_draw` (imported only where Triton is installed; the interpreter patches this
module's ``tl`` when it runs it on a CPU)."""

import triton
import triton.language as tl

__all__ = ["draw_kernel"]


def draw_kernel(  # pragma: no cover - runs as a Triton kernel
    probs, seeds, counts, best_out, where_out, total_out, least_out, vocab, span, BLOCK: tl.constexpr
):
    """Program (row, part): the row's tokens ``part * span`` to ``(part + 1) * span``, `BLOCK` at a time;
    each token's variate from Philox keyed by (seed, count, token), its score its probability over the
    variate. One Philox call gives four numbers: a block's four quarters take one each, so that each call
    keys four tokens (``c0`` the token's place in its quarter, the output its quarter)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    seed = tl.load(seeds + row)
    count = tl.load(counts + row).to(tl.uint32)
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    zero = tl.zeros([QUARTER], dtype=tl.uint32)
    best = tl.full([QUARTER], -1.0, dtype=tl.float32)
    best_at = tl.zeros([QUARTER], dtype=tl.int64)
    total = tl.zeros([QUARTER], dtype=tl.float32)
    least = tl.full([QUARTER], float("inf"), dtype=tl.float32)
    row_probs = probs + row.to(tl.int64) * vocab
    start = part * span
    for at in range(start, start + span, BLOCK):
        r0, r1, r2, r3 = tl.philox(seed, (at // 4 + lanes).to(tl.uint32), zero + count, zero, zero)
        best, best_at, total, least = _take(row_probs, at + lanes, r0, vocab, best, best_at, total, least)
        best, best_at, total, least = _take(row_probs, at + QUARTER + lanes, r1, vocab, best, best_at, total, least)
        best, best_at, total, least = _take(row_probs, at + 2 * QUARTER + lanes, r2, vocab, best, best_at, total, least)
        best, best_at, total, least = _take(row_probs, at + 3 * QUARTER + lanes, r3, vocab, best, best_at, total, least)
    top = tl.max(best, 0)
    at_top = tl.min(tl.where(best == top, best_at, vocab), 0)  # the first token of the best score
    out = row * parts + part
    tl.store(best_out + out, top)
    tl.store(where_out + out, at_top)
    tl.store(total_out + out, tl.sum(total, 0))
    tl.store(least_out + out, tl.min(least, 0))


@triton.jit
def _take(row_probs, tokens, bits, vocab, best, best_at, total, least):  # pragma: no cover - Triton
    """One quarter of a block: its tokens' scores into each lane's best so far (a lane meets its tokens in
    order, so the first of equal scores stays), their sum and their least probability."""
    inside = tokens < vocab
    p = tl.load(row_probs + tokens, mask=inside, other=0.0)
    uniform = tl.random.uint_to_uniform_float(bits)  # [0, 1)
    variate = -tl.log(uniform)  # exponential, above 0 (inf at 0: the token scores 0)
    score = tl.where(inside, p / variate, -1.0)
    better = score > best  # (a NaN never is: its row is flagged)
    best = tl.where(better, score, best)
    best_at = tl.where(better, tokens.to(tl.int64), best_at)
    total += p
    least = tl.minimum(least, tl.where(inside, p, float("inf")))
    return best, best_at, total, least
