"""Per-request timings and the figures of one concurrency level (pure Python, no I/O).

A level runs `C` closed-loop clients. Each client's first `warmup` requests are warm-up (the very
first one asks for a staggered number of tokens, so that afterwards the clients' requests end at
evenly spread times: a steady load where a new prompt arrives while the others decode). The
measurement window opens when the last client has finished its warm-up and closes when the first
client has finished its last request, so exactly `C` requests are in flight throughout it:

- output tokens/s = tokens that arrived inside the window / window length;
- TTFT = first token - request start, over the measured (non-warm-up) requests;
- ITL = gaps between consecutive tokens of measured requests whose later token is inside the window.

If the window is empty (e.g. one measured request per client and no warm-up) the level falls back
to all measured requests: first measured start to last end, all their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What one streamed request did; times are `time.perf_counter()` seconds."""

    client: int
    index: int
    warmup: bool
    expected_tokens: int
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None
    usage_tokens: int | None = None  # completion tokens the server reported (OpenAI usage)
    exact: bool = True  # False: may end early (a constrained request whose grammar completed)
    turn: int | None = None  # chat scenario: the turn (1-based) of its conversation
    conversation: int | None = None  # chat scenario: the conversation's number
    prompt_tokens: int | None = None  # OpenAI usage.prompt_tokens, when reported
    cached_tokens: int | None = None  # OpenAI usage.prompt_tokens_details.cached_tokens, when reported
    text: list[str] = field(default_factory=list)  # chat scenario: the streamed reply's pieces

    @property
    def tokens(self) -> int:
        """Tokens received: one per jsonlines token line / OpenAI chunk, or the reported usage."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def count_ok(self) -> bool:
        """Exactly the forced tokens (1 to that many for a request that may end early)."""
        if self.error is not None or not self.token_times:
            return False
        return self.tokens == self.expected_tokens if self.exact else 0 < self.tokens <= self.expected_tokens


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(seconds: Iterable[float]) -> dict[str, float | int | None]:
    """p50/p99/mean/max in milliseconds and the sample count."""
    values = [s * 1000.0 for s in seconds]
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {
        "p50": _round(p50),
        "p99": _round(p99),
        "mean": _round(sum(values) / len(values)) if values else None,
        "max": _round(max(values)) if values else None,
        "count": len(values),
    }


def measurement_window(records: Sequence[RequestRecord]) -> tuple[float, float, bool]:
    """(start, end, steady): the window with every client busy, or the fallback (steady False)."""
    clients = {r.client for r in records}
    done = [(r, r.end) for r in records if r.end is not None]
    measured = [(r, end) for r, end in done if not r.warmup]
    # a client is busy from the end of its warm-up (or its first request) to the end of its last one
    busy_from: dict[int, float | None] = {
        c: max(
            (end for r, end in done if r.client == c and r.warmup),
            default=min((r.start for r in records if r.client == c), default=None),
        )
        for c in clients
    }
    last_ends = {c: max((end for r, end in done if r.client == c), default=None) for c in clients}
    starts = [t for t in busy_from.values() if t is not None]
    ends = [t for t in last_ends.values() if t is not None]
    if measured and len(starts) == len(busy_from) and len(ends) == len(last_ends):
        t0, t1 = max(starts), min(ends)
        if t1 > t0:
            return t0, t1, True
    if not measured:
        return 0.0, 0.0, False
    return min(r.start for r, _ in measured), max(end for _, end in measured), False


def level_summary(concurrency: int, records: Sequence[RequestRecord], elapsed: float) -> dict[str, Any]:
    """The JSON figures of one level (see the module docstring)."""
    t0, t1, steady = measurement_window(records)
    measured = [r for r in records if not r.warmup and r.error is None]
    if steady:
        tokens = sum(1 for r in records for t in r.token_times if t0 <= t <= t1)
        itl = [b - a for r in measured for a, b in zip(r.token_times, r.token_times[1:]) if t0 <= b <= t1]
    else:
        tokens = sum(len(r.token_times) for r in measured)
        itl = [b - a for r in measured for a, b in zip(r.token_times, r.token_times[1:])]
    window = t1 - t0
    ttft = distribution_ms(r.ttft for r in measured if r.ttft is not None)
    itl_ms = distribution_ms(itl)
    errors = [r for r in records if r.error is not None]
    wrong = [r for r in records if r.error is None and not r.count_ok]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "measured_requests": len(measured),
        "failed_requests": len(errors),
        "errors": sorted({r.error for r in errors if r.error})[:5],
        "token_count_errors": len(wrong),
        "token_count_examples": [
            {"expected": r.expected_tokens, "received": r.tokens, "chunks": len(r.token_times)} for r in wrong[:5]
        ],
        "tokens_expected": sum(r.expected_tokens for r in records),
        "tokens_received": sum(r.tokens for r in records),
        "steady_window": steady,
        "window_s": _round(window, 3),
        "window_tokens": tokens,
        "elapsed_s": _round(elapsed, 3),
        "output_tokens_per_s": _round(tokens / window) if window > 0 else None,
        "ttft_ms": ttft,
        "itl_ms": itl_ms,
        "itl_p99_over_p50": ratio(itl_ms["p99"], itl_ms["p50"]),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded to 3 decimals; None if either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return round(numerator / denominator, 3)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)
