"""TGI's Prometheus metrics of the engines' work (`TgiMetrics`): one server-wide set, no model label, as
TGI serves one model. Names, types and histogram buckets are those of TGI's router; its counters are
named without ``_total``, as TGI names them. docs/metrics.md, "The metrics", lists them.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric

from lmiserve.core.errors import InvalidRequest, Overloaded, QueueTimeout
from lmiserve.core.events import FinishReason
from lmiserve.core.limits import limits_for
from lmiserve.core.stats import RequestStats
from lmiserve.models.service import ModelService

# TGI: every "*duration" histogram: 35 buckets growing by 1.5 from 0.15 ms (router/src/server.rs)
TGI_DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


def tgi_error(request: RequestStats | None, error: BaseException | None = None) -> str:
    """TGI's ``err`` label of a failed request: validation, overloaded, dropped (the client went away),
    generation; and lmiserve's timeout (waited longer than predict_timeout for a batch slot)."""
    error = error if error is not None else (request.error if request is not None else None)
    if isinstance(error, InvalidRequest):
        return "validation"
    if isinstance(error, Overloaded):
        return "overloaded"
    if isinstance(error, QueueTimeout):
        return "timeout"
    if error is None and request is not None and any(s.reason is FinishReason.ABORT for s in request.sequences):
        return "dropped"
    return "generation"


def _linear(maximum: int) -> list[float]:
    """TGI's token-count buckets: 100 steps up to `maximum`."""
    return [maximum / 100 * (x + 1) for x in range(100)]


class TgiMetrics:
    """TGI's metrics, server-wide. Its counters are named as TGI names them (no ``_total``), so they
    are exposed by `collect` rather than as `prometheus_client.Counter`s."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self.counts: Tally[str] = Tally()  # tgi_request_count, tgi_request_success
        self.failures: Tally[str] = Tally()  # tgi_request_failure by err
        self.inference: Tally[str] = Tally()  # tgi_batch_inference_count by method
        d = TGI_DURATION_BUCKETS
        self.duration = Histogram(
            "tgi_request_duration",
            "Total time spent processing the request (e2e latency)",
            buckets=d,
            registry=registry,
        )
        self.queue = Histogram(
            "tgi_request_queue_duration", "Time spent in the queue per request", buckets=d, registry=registry
        )
        self.inference_duration = Histogram(
            "tgi_request_inference_duration", "Request inference duration", buckets=d, registry=registry
        )
        self.per_token = Histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean time per token per request (inter-token latency)",
            buckets=d,
            registry=registry,
        )
        self.forward = Histogram(
            "tgi_batch_forward_duration",
            "Batch forward duration per method (prefill or decode)",
            ["method"],
            buckets=d,
            registry=registry,
        )
        self._input_length: Histogram | None = None  # buckets from the model's limits: made at first use
        self._generated: Histogram | None = None

    def token_histograms(self, service: ModelService) -> tuple[Histogram, Histogram]:
        """tgi_request_input_length and tgi_request_generated_tokens, whose buckets follow the first
        model's max_input_tokens and max_total_tokens as TGI's follow its model's."""
        with self._lock:
            if self._input_length is None or self._generated is None:
                limits = limits_for(service)
                self._input_length = Histogram(
                    "tgi_request_input_length",
                    "Input token length per request",
                    buckets=_linear(limits.max_input_tokens),
                    registry=self._registry,
                )
                self._generated = Histogram(
                    "tgi_request_generated_tokens",
                    "Generated tokens per request",
                    buckets=_linear(limits.max_total_tokens),
                    registry=self._registry,
                )
            return self._input_length, self._generated

    def collect(self) -> Iterator[Metric]:
        """The counters, as TGI exposes them: ``tgi_request_count 3`` under ``# TYPE tgi_request_count counter``."""
        yield _bare_counter("tgi_request_count", "Total number of requests", {"": self.counts["count"]})
        yield _bare_counter("tgi_request_success", "Number of successful requests", {"": self.counts["success"]})
        yield _bare_counter("tgi_request_failure", "Number of failed requests per error", self.failures, "err")
        yield _bare_counter(
            "tgi_batch_inference_count", "Inference calls per method (prefill or decode)", self.inference, "method"
        )


def _bare_counter(name: str, documentation: str, values: Mapping[str, int], label: str = "") -> Metric:
    """A counter family whose samples carry the family's own name (TGI's style), one per value of
    `label` (one unlabelled sample under the key "" when `label` is empty); `scrape.exposition` writes
    its ``# TYPE`` line with that name."""
    metric = Metric(name, documentation, "counter")
    for value, count in sorted(values.items()):
        metric.add_sample(name, {label: value} if label else {}, count)
    return metric
