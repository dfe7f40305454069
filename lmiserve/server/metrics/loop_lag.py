"""The HTTP event loop's lag: how late a timer due every `INTERVAL` seconds runs.

Every connection's parsing, hand-over and writing shares the one asyncio loop; anything that runs on it
for long (a tokenizer call, JSON encoding of a large body, a grammar compile) delays every other request by
as much. `lmiserve_event_loop_lag_seconds` counts those delays as seen by a periodic wake-up: a loop that
only parses, hands over and writes bytes stays in the lowest buckets under load.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

INTERVAL = 0.1  # seconds between wake-ups
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "lmiserve_event_loop_lag_seconds",
            f"How late the HTTP event loop ran a wake-up due every {INTERVAL} s (the time any request waited "
            "for the loop then).",
            buckets=LAG_BUCKETS,
            registry=registry,
        )

    async def watch(self, interval: float = INTERVAL) -> None:
        """Observe the lag of every wake-up until cancelled (the app's lifespan runs it)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.histogram.observe(max(0.0, loop.time() - due))
