"""The exposition writes TGI's counters as TGI does, TGI's `err` labels follow the neutral errors, and
metrics_port is checked against the serving port."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from lmiserve.config import ConfigError, load_settings
from lmiserve.core.errors import GenerationFailed, InvalidRequest, ModelNotReady, Overloaded, QueueTimeout
from lmiserve.core.events import FinishReason
from lmiserve.core.stats import RequestStats, SequenceStats
from lmiserve.server.metrics.scrape import exposition
from lmiserve.server.metrics.tgi import TgiMetrics, tgi_error


def test_tgi_counters_keep_their_name_and_others_get_total():
    registry = CollectorRegistry()
    tgi = TgiMetrics(registry)
    registry.register(tgi)
    Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry).labels("m").inc(3)
    tgi.counts["count"] += 2
    tgi.failures["validation"] += 1
    text = exposition(registry, ["tgi_request_count", "tgi_request_success", "tgi_request_failure"]).decode()
    assert "# TYPE tgi_request_count counter\ntgi_request_count 2.0\n" in text
    assert "# TYPE tgi_request_success counter\ntgi_request_success 0.0\n" in text
    assert '# TYPE tgi_request_failure counter\ntgi_request_failure{err="validation"} 1.0\n' in text
    assert '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name="m"} 3.0\n' in text
    assert "# TYPE tgi_request_duration histogram\n" in text
    assert "untyped" not in text


def _request(reason: FinishReason, error: BaseException | None = None) -> RequestStats:
    seq = SequenceStats(0.0, None, None, 1.0, 3, 0, 5, reason)
    return RequestStats(0.0, 1.0, 3, (seq,), error)


@pytest.mark.parametrize(
    "request_stats,error,label",
    [
        (None, InvalidRequest("too long"), "validation"),
        (None, Overloaded("queue full"), "overloaded"),
        (_request(FinishReason.ERROR, QueueTimeout("late")), None, "timeout"),
        (_request(FinishReason.ABORT), None, "dropped"),
        (_request(FinishReason.ERROR), None, "generation"),
        (_request(FinishReason.ERROR, ModelNotReady("shutting down")), None, "generation"),
        (None, GenerationFailed("boom"), "generation"),
    ],
)
def test_tgi_error_labels(request_stats, error, label):
    assert tgi_error(request_stats, error) == label


def test_metrics_port_must_differ_from_the_serving_port():
    assert load_settings({"metrics_port": 9090}, environ={}).metrics_port == 9090
    with pytest.raises(ConfigError, match="metrics_port=8080 must differ from port"):
        load_settings({"metrics_port": 8080}, environ={})


def test_event_loop_lag_counts_how_late_the_loop_ran_a_timer():
    """A loop blocked for 0.2 s shows a wake-up about 0.2 s late. (A busy machine may make other wake-ups late
    too, so the bounds are what the scenario's own time allows: each wake-up waited its 0.01 s first.)"""
    import asyncio
    import time

    from prometheus_client import CollectorRegistry

    from lmiserve.server.metrics.loop_lag import LoopLag

    lag = LoopLag(CollectorRegistry())

    async def scenario() -> None:
        task = asyncio.create_task(lag.watch(interval=0.01))
        await asyncio.sleep(0.05)  # idle: wake-ups on time
        time.sleep(0.2)  # the loop held by blocking work
        await asyncio.sleep(0.05)
        task.cancel()

    start = time.monotonic()
    asyncio.run(scenario())
    elapsed = time.monotonic() - start
    collected = lag.histogram.collect()[0].samples
    samples = {s.name: s.value for s in collected if not s.labels.get("le")}
    below = {float(s.labels["le"]): s.value for s in collected if s.labels.get("le")}
    count = samples["lmiserve_event_loop_lag_seconds_count"]
    assert count >= 5
    assert count - below[0.1] >= 1  # the blocked wake-up: more than 0.1 s late
    assert 0.15 <= samples["lmiserve_event_loop_lag_seconds_sum"] <= elapsed - 0.01 * count
