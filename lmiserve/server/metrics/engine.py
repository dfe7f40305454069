"""The engines' work as TGI's and vLLM's Prometheus metrics.

`ModelObserver` (one per served model) is the `lmiserve.core.stats.EngineObserver` of that model's
engine: it records what the engine reports into TGI's metrics (one server-wide set, no model label, as
TGI serves one model) and vLLM's (labelled ``model_name`` and ``engine``, as vLLM's are). The gauges
(batch size, queue size, KV cache use) and the preemption counter are not kept here: `LiveCollector`
reads the engines' live state (`EngineSnapshot`) when Prometheus scrapes. Names, types, labels and
histogram buckets are those of TGI's router and of current vLLM (vllm/v1/metrics/loggers.py);
docs/metrics.md, "The metrics", lists them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmiserve.core.errors import InvalidRequest, LmiServeError, Overloaded, QueueTimeout
from lmiserve.core.events import FinishReason
from lmiserve.core.limits import limits_for
from lmiserve.core.stats import EngineSnapshot, RequestStats, StepStats
from lmiserve.models.service import ModelService

ENGINE = "0"  # vLLM's engine label: lmiserve runs one engine per model

# TGI: every "*duration" histogram: 35 buckets growing by 1.5 from 0.15 ms (router/src/server.rs)
TGI_DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
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


class ModelObserver:
    """The `EngineObserver` of one model's engine: records into TGI's and vLLM's metrics."""

    def __init__(self, service: ModelService, tgi: TgiMetrics, vllm: VllmMetrics) -> None:
        self.service = service
        self.tgi = tgi
        self.vllm = vllm

    @property
    def _labels(self) -> tuple[str, str]:
        return self.service.name, ENGINE  # read each time: a model's name can be fixed only once it loaded

    def on_rejected(self, error: BaseException) -> None:
        self.tgi.counts["count"] += 1
        self.tgi.failures[tgi_error(None, error)] += 1

    def on_submitted(self, prompt_tokens: int, sequences: int) -> None:
        self.tgi.counts["count"] += 1
        self.tgi.token_histograms(self.service)[0].observe(prompt_tokens)

    def on_step(self, step: StepStats) -> None:
        self.tgi.inference[step.method] += 1
        self.tgi.forward.labels(step.method).observe(step.duration)
        labels = self._labels
        if step.prompt_tokens or step.prefix_hit_tokens:  # every prompt token, computed or from the cache
            self.vllm.prompt_tokens.labels(*labels).inc(step.prompt_tokens + step.prefix_hit_tokens)
        if step.prefix_queried_tokens:
            self.vllm.prefix_queries.labels(*labels).inc(step.prefix_queried_tokens)
            self.vllm.prefix_hits.labels(*labels).inc(step.prefix_hit_tokens)
        if step.generated_tokens:
            self.vllm.generation_tokens.labels(*labels).inc(step.generated_tokens)
        for latency in step.first_token_latencies:
            self.vllm.ttft.labels(*labels).observe(latency)
        itl = self.vllm.itl.labels(*labels)
        for gap in step.inter_token_latencies:
            itl.observe(gap)

    def on_finished(self, request: RequestStats) -> None:
        labels = self._labels
        self.vllm.declare(labels[0])
        for seq in request.sequences:
            self.vllm.success.labels(*labels, VLLM_REASON[seq.reason]).inc()
            self.vllm.e2e.labels(*labels).observe(seq.finished - seq.arrival)
            self.vllm.queue.labels(*labels).observe(seq.queue_time)
            if seq.scheduled is not None:
                self.vllm.inference.labels(*labels).observe(seq.finished - seq.scheduled)
                first = seq.first_token if seq.first_token is not None else seq.finished
                self.vllm.prefill.labels(*labels).observe(first - seq.scheduled)
                self.vllm.decode.labels(*labels).observe(seq.finished - first)
        if not request.succeeded:
            self.tgi.failures[tgi_error(request)] += 1
            return
        tgi = self.tgi
        tgi.counts["success"] += 1
        queue = max((s.queue_time for s in request.sequences), default=0.0)
        inference = request.finished - request.arrival - queue
        tgi.duration.observe(request.finished - request.arrival)
        tgi.queue.observe(queue)
        tgi.inference_duration.observe(inference)
        longest = max((s.generated_tokens for s in request.sequences), default=0)
        if longest:
            tgi.per_token.observe(inference / longest)
        tgi.token_histograms(self.service)[1].observe(sum(s.generated_tokens for s in request.sequences))


class LiveCollector(Collector):
    """The gauges, read from the engines when Prometheus scrapes: TGI's (summed over the served LLMs)
    and vLLM's (per model); and vLLM's preemption counter, which the engine keeps."""

    def __init__(self, models: Callable[[], Iterable[ModelService]], tgi: TgiMetrics, vllm: VllmMetrics) -> None:
        self._models = models
        self._tgi = tgi
        self._vllm = vllm

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels
        )
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        prefix = GaugeMetricFamily(
            "lmiserve_prefix_cache_usage_perc",
            "Prefix cache usage: tokens held / tokens it can hold. 1 means 100 percent usage.",
            labels=labels,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=labels
        )
        spec = _SpecDecodeFamilies(labels)
        lora = _LoraFamilies()
        size = queue = max_tokens = 0
        for service in self._models():
            engine = _generator(service)
            if engine is None:
                continue
            snap = engine.snapshot()
            values = [service.name, ENGINE]
            running.add_metric(values, snap.running)
            waiting.add_metric(values, snap.waiting)
            kv.add_metric(values, snap.kv_usage)
            preemptions.add_metric(values, snap.preemptions)
            if snap.prefix_cache_capacity:
                prefix.add_metric(values, snap.prefix_cache_usage)
            if snap.speculation is not None:
                spec.add(values, snap.speculation)
            if snap.max_loras:
                lora.add(service, snap)
            size, queue, max_tokens = size + snap.running, queue + snap.waiting, max_tokens + snap.batch_max_tokens
        yield running
        yield waiting
        yield kv
        yield prefix
        yield preemptions
        yield from spec.families()
        yield from lora.families()
        yield GaugeMetricFamily("tgi_batch_current_size", "Current batch size", value=size)
        yield GaugeMetricFamily(
            "tgi_batch_current_max_tokens", "Maximum tokens for the current batch", value=max_tokens
        )
        yield GaugeMetricFamily("tgi_queue_size", "Current queue size", value=queue)
        yield from self._tgi.collect()
        yield from self._vllm.time_per_output_token()


class _SpecDecodeFamilies:
    """vLLM's speculative decoding counters, read from the engine snapshots (engine/speculative.py)."""

    def __init__(self, labels: list[str]) -> None:
        self.drafts = CounterMetricFamily(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels=labels
        )
        self.draft_tokens = CounterMetricFamily(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels=labels
        )
        self.accepted = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels=labels
        )
        self.per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labels, "position"],
        )
        self.any = False

    def add(self, values: list[str], spec: dict[str, Any]) -> None:
        self.any = True
        self.drafts.add_metric(values, spec["num_drafts"])
        self.draft_tokens.add_metric(values, spec["num_draft_tokens"])
        self.accepted.add_metric(values, spec["num_accepted_tokens"])
        for position, count in enumerate(spec["accepted_per_position"]):
            self.per_position.add_metric([*values, str(position)], count)

    def families(self) -> Iterator[Metric]:
        if self.any:
            yield from (self.drafts, self.draft_tokens, self.accepted, self.per_position)


class _LoraFamilies:
    """vLLM's LoRA gauge (``vllm:lora_requests_info``: the adapters of the running and of the waiting
    requests as label values, comma-joined; its value the time of the scrape, as vLLM sets it to the time
    of its last update), with lmiserve's ``model_name`` label; and lmiserve's per-adapter figures, read
    from the model's adapter registry (engine/lora_registry.py)."""

    def __init__(self) -> None:
        self.info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "model_name"],
        )
        self.requests = CounterMetricFamily(
            "lmiserve_lora_requests",
            "Requests served by each LoRA adapter since it was registered.",
            labels=["model_name", "adapter"],
        )
        self.running = GaugeMetricFamily(
            "lmiserve_lora_running_requests",
            "Requests running on each LoRA adapter now (in the batch or waiting for a place in it).",
            labels=["model_name", "adapter"],
        )
        self.registered = GaugeMetricFamily(
            "lmiserve_lora_adapters_registered", "LoRA adapters registered.", labels=["model_name"]
        )
        self.loaded = GaugeMetricFamily(
            "lmiserve_lora_adapters_loaded",
            "LoRA adapters whose weights are in memory (at most max_cpu_loras, plus those in use or pinned).",
            labels=["model_name"],
        )
        self.any = False

    def add(self, service: ModelService, snap: EngineSnapshot) -> None:
        self.any = True
        name = service.name
        running, waiting = ",".join(snap.lora_running), ",".join(snap.lora_waiting)
        self.info.add_metric([str(snap.max_loras), waiting, running, name], time.time())
        registry = service.adapters
        if registry is None:
            return
        in_use = registry.running()
        entries = registry.entries()
        for entry in entries:
            self.requests.add_metric([name, entry.name], entry.requests)
            self.running.add_metric([name, entry.name], in_use.get(entry.name, 0))
        self.registered.add_metric([name], len(entries))
        self.loaded.add_metric([name], registry.loaded_count())

    def families(self) -> Iterator[Metric]:
        if self.any:
            yield from (self.info, self.requests, self.running, self.registered, self.loaded)


def _generator(service: ModelService):  # -> TextGenerator | None
    """The ready LLM engine of `service`, else None (loading, failed, not an LLM)."""
    if not service.is_llm:
        return None
    try:
        return service.ready_generator()
    except LmiServeError:
        return None
