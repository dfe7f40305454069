"""`GET /metrics`: the Prometheus text exposition (format 0.0.4) of one app's metrics.

On the serving port the route is registered through `protocol_routes` like every route that is not a
probe: it needs the API key when one is set (SECURITY.md). On `metrics_port` (server/metrics/port.py)
it is open: that port is meant for the scraper and closed to everyone else by the network.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import HeadersTooLarge, LmiServeError, PayloadTooLarge, Unauthorized
from lmiserve.server import apidoc
from lmiserve.server.errors import ErrorRenderer, lookup, protocol_routes

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class MetricsErrors(ErrorRenderer):
    """The errors /metrics can meet (the guard's): a plain-text message."""

    content_type = "text/plain; charset=utf-8"
    protocol = "metrics"

    def status(self, exc: LmiServeError) -> int:
        return lookup(exc, {Unauthorized: 401, PayloadTooLarge: 413, HeadersTooLarge: 431}, 500)

    def body(self, exc: LmiServeError) -> bytes:
        return exc.message.encode("utf-8")


RENDERER = MetricsErrors()


class _One:
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric


def exposition(registry: CollectorRegistry, bare_counters: Iterable[str] = ()) -> bytes:
    """The registry's metrics in the text format. The counters named in `bare_counters` keep their own
    name (``# TYPE tgi_request_count counter`` / ``tgi_request_count 3``, as TGI's exporter writes
    them) where prometheus_client would name the family ``..._total``."""
    bare = set(bare_counters)
    out: list[bytes] = []
    for metric in registry.collect():
        if metric.type == "counter" and metric.name in bare:
            untyped = Metric(metric.name, metric.documentation, "unknown")
            untyped.samples = metric.samples
            text = generate_latest(_One(untyped))
            out.append(text.replace(f"# TYPE {metric.name} untyped".encode(), f"# TYPE {metric.name} counter".encode()))
        else:
            out.append(generate_latest(_One(metric)))
    return b"".join(out)


def metrics_response(registry: CollectorRegistry, bare_counters: Iterable[str]) -> Response:
    return Response(exposition(registry, bare_counters), media_type=CONTENT_TYPE)


def routes(registry: CollectorRegistry, bare_counters: Iterable[str]) -> list[BaseRoute]:
    """``GET /metrics`` on the serving port: needs the API key when one is set."""
    names = tuple(bare_counters)

    async def metrics(request: Request) -> Response:
        return metrics_response(registry, names)

    operation = apidoc.Operation(
        "Prometheus metrics (TGI's and vLLM's names)",
        "Metrics",
        apidoc.ok("The Prometheus text exposition", {CONTENT_TYPE: apidoc.STRING}),
    )
    return protocol_routes(RENDERER, [apidoc.document(Route("/metrics", metrics, methods=["GET"]), operation)])
