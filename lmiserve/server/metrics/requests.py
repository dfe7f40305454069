"""Request count and latency per protocol, model and status, for every route.

`RequestCollectors.observe` counts each HTTP request once it is over, from the request's facts
(lmiserve.core.request_context) that `lmiserve.server.access.RequestLog` keeps: its time from arrival
to the last byte of its response (a stream included), its status, and what the route layer noted: the
protocol (the route group's renderer, `server.errors.rendered_by`) and the model
(`server.lookup.model_service` / `default_llm`). A request no route took (404) counts
under protocol ``none``; one that named no model, or an unknown one, under model ``""``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from lmiserve.core.request_context import RequestFacts

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RequestCollectors:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "lmiserve_requests",
            "HTTP requests by protocol, model and response status.",
            ["protocol", "model", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "lmiserve_request_duration_seconds",
            "HTTP request duration in seconds, from arrival to the last byte of the response.",
            ["protocol", "model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )

    def observe(self, facts: RequestFacts) -> None:
        """One finished request (`lmiserve.server.access.RequestLog` calls this after its access line)."""
        protocol, model = facts.protocol or "none", facts.model or ""
        end = facts.end if facts.end is not None else time.monotonic()
        self.requests.labels(protocol, model, str(facts.status)).inc()
        self.duration.labels(protocol, model).observe(end - facts.start)
