"""The engines' live state as Prometheus metrics, read when Prometheus scrapes (`LiveCollector`): the
gauges of TGI (batch size, queue size, summed over the served LLMs) and vLLM (per model: running and
waiting requests, KV cache use), vLLM's preemption, speculative decoding and LoRA figures, and
lmiserve's prefix cache and per-adapter figures, from each engine's `EngineSnapshot`. It also yields
TGI's bare counters and vLLM's deprecated alias of the inter-token latency at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lmiserve.core.errors import LmiServeError
from lmiserve.core.stats import EngineSnapshot
from lmiserve.models.service import ModelService
from lmiserve.server.metrics.tgi import TgiMetrics
from lmiserve.server.metrics.vllm import ENGINE, VllmMetrics


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
        steps = CounterMetricFamily(
            "lmiserve_engine_steps", "Model steps the engine ran (a batch's forward and sampling).", labels=labels
        )
        ahead = CounterMetricFamily(
            "lmiserve_engine_steps_planned_ahead",
            "Model steps planned while the step before them ran (overlap scheduling, async_scheduling).",
            labels=labels,
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
            steps.add_metric(values, snap.model_steps)
            ahead.add_metric(values, snap.steps_planned_ahead)
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
        yield steps
        yield ahead
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
    """vLLM's speculative decoding counters, read from the engine snapshots (engine/speculative/proposers.py)."""

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
    from the model's adapter registry (engine/lora/registry.py)."""

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
