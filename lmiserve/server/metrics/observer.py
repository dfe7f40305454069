"""The engines' work as TGI's and vLLM's Prometheus metrics.

`ModelObserver` (one per served model) is the `lmiserve.core.stats.EngineObserver` of that model's
engine: it records what the engine reports into TGI's metrics (metrics/tgi.py: one server-wide set, no
model label, as TGI serves one model) and vLLM's (metrics/vllm.py: labelled ``model_name`` and
``engine``, as vLLM's are). The gauges (batch size, queue size, KV cache use) and the preemption
counter are not kept here: `metrics/live.py`'s `LiveCollector` reads the engines' live state
(`EngineSnapshot`) when Prometheus scrapes. docs/metrics.md, "The metrics", lists them.
"""

from __future__ import annotations

from lmiserve.core.stats import RequestStats, StepStats
from lmiserve.models.service import ModelService
from lmiserve.server.metrics.tgi import TgiMetrics, tgi_error
from lmiserve.server.metrics.vllm import ENGINE, VLLM_REASON, VllmMetrics


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
