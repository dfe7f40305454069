"""The drain: what a stopping server does between the stop signal and closing its listeners.

From the first SIGTERM or SIGINT (`lmiserve.server.lifecycle.Lifecycle.request_stop`) the server's
`Drain` is active, and:

- every route but the liveness probe answers `ShuttingDown`, 503 in its protocol's shape: the
  health and readiness probes at once (so a load balancer takes the replica out), and every new
  request. It is raised in one place, `lmiserve.server.guard.admit`, which every route passes;
- the listeners stay open meanwhile, so a client gets that 503 rather than "connection refused";
- the requests already in flight (streams included) run on until they end, up to `drain_timeout`
  seconds after the signal (`wait_for_open_requests`);
- at that deadline, the engines are stopped: whatever still runs ends with `ShuttingDown` (a
  stream: its protocol's in-band error, then its end; a whole answer: a 503);
- then uvicorn closes the listeners and the connections, the lifespan stops, the process exits 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection


class Drain:
    """Whether the server drains (set once, never unset: a drain ends with the process)."""

    def __init__(self) -> None:
        self.started: float | None = None  # time.monotonic() of the stop signal

    @property
    def active(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        """Start draining (idempotent; safe from a signal handler: it only sets a field)."""
        if self.started is None:
            self.started = time.monotonic()

    def remaining(self, timeout: float) -> float:
        """Seconds left until `timeout` seconds after the start (`timeout` if not started)."""
        if self.started is None:
            return timeout
        return max(0.0, self.started + timeout - time.monotonic())


async def wait_for_open_requests(
    requests: Collection[asyncio.Task[object]],
    timeout: float,
    tick: Callable[[], Awaitable[object]] | None = None,
    interval: float = 1.0,
) -> int:
    """Wait until every task of `requests` is done or `timeout` seconds passed; the number still open.

    `tick` runs every `interval` seconds meanwhile (uvicorn's main loop, which refreshes the Date
    header, no longer runs once the stop began)."""
    deadline = time.monotonic() + timeout
    pending = {task for task in requests if not task.done()}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(interval, left))
        if tick is not None:
            await tick()
    return len(pending)
