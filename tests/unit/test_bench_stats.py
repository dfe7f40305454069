"""`lmiserve bench` statistics on synthetic timings: percentiles, the measurement window, per-level
figures, the staggered warm-up and the prompt schedule."""

from __future__ import annotations

import numpy as np
import pytest

from lmiserve.bench.clients import stagger
from lmiserve.bench.prompts import PROMPTS, SHORT_PROMPTS, batch_prompts, client_prompt, soak_prompt
from lmiserve.bench.stats import RequestRecord, distribution_ms, level_summary, measurement_window, percentile, ratio


@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0], list(np.linspace(0.0, 1.0, 37) ** 2)])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_is_in_milliseconds():
    d = distribution_ms([0.001, 0.002, 0.003, 0.004])
    assert d == {"p50": 2.5, "p99": 3.97, "mean": 2.5, "max": 4.0, "count": 4}
    assert distribution_ms([]) == {"p50": None, "p99": None, "mean": None, "max": None, "count": 0}


def test_ratio():
    assert ratio(170.0, 200.0) == 0.85
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0) is None


def record(client, index, warmup, start, gaps, expected=None, error=None):
    """A finished request: first token `gaps[0]` s after `start`, then one token per further gap."""
    times, t = [], start
    for gap in gaps:
        t += gap
        times.append(t)
    return RequestRecord(
        client=client,
        index=index,
        warmup=warmup,
        start=start,
        token_times=times,
        end=t + 0.001,
        error=error,
        expected_tokens=len(gaps) if expected is None else expected,
    )


def two_client_level():
    """Client 0: warm-up 0..0.5 s (5 tokens), measured 0.5..1.5 s and 1.5..2.5 s.
    Client 1: warm-up 0..1.0 s (10 tokens), measured 1.0..2.0 s and 2.0..3.0 s. 10 tokens per
    measured request, first after 0.1 s, then every 0.1 s (client 1 at 2.0..3.0 s: 0.05 s TTFT)."""
    return [
        record(0, 0, True, 0.0, [0.1] * 5),
        record(0, 1, False, 0.5, [0.1] * 10),
        record(0, 2, False, 1.501, [0.1] * 10),
        record(1, 0, True, 0.0, [0.1] * 10),
        record(1, 1, False, 1.001, [0.1] * 10),
        record(1, 2, False, 2.002, [0.05] + [0.1] * 9),
    ]


def test_window_spans_the_time_every_client_is_measured():
    t0, t1, steady = measurement_window(two_client_level())
    assert steady
    assert t0 == pytest.approx(1.001)  # client 1's warm-up end
    assert t1 == pytest.approx(2.502)  # client 0's last end


def test_window_falls_back_to_all_measured_requests_when_empty():
    records = [record(0, 0, False, 0.0, [0.1] * 4), record(1, 0, False, 1.0, [0.1] * 4)]
    t0, t1, steady = measurement_window(records)
    assert not steady and (t0, t1) == (0.0, pytest.approx(1.401))


def test_level_summary_counts_window_tokens_and_latencies():
    level = level_summary(2, two_client_level(), elapsed=3.1)
    assert level["concurrency"] == 2
    assert level["requests"] == 6 and level["measured_requests"] == 4
    assert level["failed_requests"] == 0 and level["token_count_errors"] == 0
    assert level["tokens_expected"] == level["tokens_received"] == 5 + 10 + 10 + 10 + 10 + 10
    assert level["steady_window"] is True
    # tokens with 1.001 <= t <= 2.502: client 0 request 1 (1.1..1.5: 5), request 2 (1.601..2.501: 10),
    # client 1 request 1 (1.101..2.001: 10), request 2 (2.052..2.452: 5)
    assert level["window_tokens"] == 30
    assert level["output_tokens_per_s"] == pytest.approx(30 / 1.501, abs=0.01)
    assert level["ttft_ms"]["count"] == 4
    assert level["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert level["ttft_ms"]["max"] == pytest.approx(100.0) and level["ttft_ms"]["mean"] == pytest.approx(87.5)
    assert level["itl_ms"]["p50"] == pytest.approx(100.0)
    assert level["itl_p99_over_p50"] == pytest.approx(1.0)


def test_level_summary_reports_failures_and_wrong_counts():
    records = [
        record(0, 0, False, 0.0, [0.1] * 4, expected=4),
        record(0, 1, False, 0.5, [0.1] * 3, expected=4),  # one token short
        record(1, 0, False, 0.0, [], expected=4, error="HTTP 500: boom"),
    ]
    level = level_summary(2, records, elapsed=1.0)
    assert level["failed_requests"] == 1 and level["errors"] == ["HTTP 500: boom"]
    assert level["token_count_errors"] == 1
    assert level["token_count_examples"] == [{"expected": 4, "received": 3, "chunks": 3}]
    assert level["tokens_expected"] == 12 and level["tokens_received"] == 7


def test_usage_overrides_chunk_count():
    r = record(0, 0, False, 0.0, [0.1] * 3, expected=4)
    assert not r.count_ok
    r.usage_tokens = 4
    assert r.tokens == 4 and r.count_ok


@pytest.mark.parametrize("concurrency", [1, 2, 8, 32])
def test_stagger_spreads_first_requests_up_to_n(concurrency):
    lengths = [stagger(c, concurrency, 128) for c in range(concurrency)]
    assert lengths[-1] == 128 and all(1 <= x <= 128 for x in lengths)
    assert lengths == sorted(lengths) and len(set(lengths)) == concurrency


def test_prompt_schedule_is_fixed_and_varied():
    assert client_prompt(0, 0, 8) == PROMPTS[0] and client_prompt(3, 2, 8) == PROMPTS[19 % len(PROMPTS)]
    assert batch_prompts(3) == list(PROMPTS[:3]) and len(batch_prompts(32)) == 32
    lengths = sorted(len(p.split()) for p in PROMPTS)
    assert lengths[0] <= 5 and lengths[-1] >= 150 and len(set(lengths)) >= 10
    assert all(len(p.split()) <= 20 for p in SHORT_PROMPTS) and soak_prompt(len(SHORT_PROMPTS)) == SHORT_PROMPTS[0]


def test_a_level_reports_its_clients_cpu_and_says_when_it_measured_the_client():
    from lmiserve.bench.client_processes import ClientRun
    from lmiserve.bench.measure import CLIENT_BOUND, client_cost

    level: dict = {}
    assert client_cost(level, ClientRun([], 4.0, 1.0, 0.25), 1) == ""
    assert level == {"client_processes": 1, "client_cpu_s": 1.0, "client_busy": 0.25}
    note = client_cost(level, ClientRun([], 4.0, 5.0, 0.95), 2)
    assert level == {"client_processes": 2, "client_cpu_s": 5.0, "client_busy": 0.95} and CLIENT_BOUND <= 0.95
    assert note == "; a client process used 95% of a core: this level may measure the client (--client-processes)"
