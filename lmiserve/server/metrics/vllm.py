"""vLLM's per-model Prometheus metrics of the engines' work (`VllmMetrics`, labelled ``model_name`` and
``engine``, as vLLM's are). Names, types, labels and histogram buckets are those of current vLLM
(vllm/v1/metrics/loggers.py); docs/metrics.md, "The metrics", lists them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric

from lmiserve.core.events import FinishReason

ENGINE = "0"  # vLLM's engine label: lmiserve runs one engine per model

# vLLM (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
VLLM_TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
VLLM_ITL_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
VLLM_LATENCY_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's finished_reason values (vllm.v1.engine.FinishReason), each present from the start as in vLLM
VLLM_REASON = {
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class VllmMetrics:
    """vLLM's per-model metrics (labels ``model_name``, ``engine``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name", "engine"]

        def counter(name: str, documentation: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, documentation, [*labels, *extra], registry=registry)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS
        )
        latency = VLLM_LATENCY_BUCKETS
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latency
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", latency
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", latency
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", latency
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", latency
        )

    def time_per_output_token(self) -> Iterator[Metric]:
        """vllm:inter_token_latency_seconds again under vLLM's name before 0.11, for older dashboards
        (renamed at scrape time: no second observation per token)."""
        old, new = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
        documentation = "Histogram of time per output token in seconds. DEPRECATED: Use " + old + " instead."
        for metric in self.itl.collect():
            alias = Metric(new, documentation, "histogram")
            for sample in metric.samples:
                alias.add_sample(new + sample.name[len(old) :], sample.labels, sample.value, sample.timestamp)
            yield alias

    def declare(self, model: str) -> None:
        """Every finished_reason of `model` at 0 from the start, as vLLM declares them."""
        for reason in sorted(set(VLLM_REASON.values())):
            self.success.labels(model, ENGINE, reason)
