"""Prometheus metrics: TGI's and vLLM's names for the engines' work, and request count and latency per
protocol and model for every route. docs/metrics.md, "The metrics", lists every metric.

`Metrics` holds one app's collectors in a registry of its own (two apps in one process never share
counters). The engines report through `lmiserve.core.stats.EngineObserver` (`observer_for`, handed to
the model registry, gives each model's engine its observer); the gauges are read from the engines at
scrape time; the route layer's requests are counted from each request's facts when it is over
(`RequestCollectors.observe`, called by `lmiserve.server.access.RequestLog`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from starlette.responses import Response
from starlette.routing import BaseRoute

from lmiserve.core.stats import EngineObserver
from lmiserve.models.service import ModelService
from lmiserve.server.metrics import scrape
from lmiserve.server.metrics.live import LiveCollector
from lmiserve.server.metrics.loop_lag import LoopLag
from lmiserve.server.metrics.observer import ModelObserver
from lmiserve.server.metrics.requests import RequestCollectors
from lmiserve.server.metrics.tgi import TgiMetrics
from lmiserve.server.metrics.vllm import VllmMetrics

__all__ = ["Metrics"]

BARE_COUNTERS = (
    "tgi_request_count",
    "tgi_request_success",
    "tgi_request_failure",
    "tgi_batch_inference_count",
)


class Metrics:
    def __init__(self, models: Callable[[], Iterable[ModelService]]) -> None:
        """`models`: the served models at scrape time."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.tgi = TgiMetrics(self.registry)
        self.vllm = VllmMetrics(self.registry)
        self.requests = RequestCollectors(self.registry)
        self.loop_lag = LoopLag(self.registry)  # its `watch()` runs in the app's lifespan
        self.registry.register(LiveCollector(models, self.tgi, self.vllm))

    def observer_for(self, service: ModelService) -> EngineObserver:
        return ModelObserver(service, self.tgi, self.vllm)

    def response(self) -> Response:
        return scrape.metrics_response(self.registry, BARE_COUNTERS)

    def routes(self) -> list[BaseRoute]:
        return scrape.routes(self.registry, BARE_COUNTERS)
