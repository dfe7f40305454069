"""Wait for a condition instead of sleeping for a guessed time.

A test that hands work to another task, thread or process waits until it can see the result
(`wait_until(lambda: engine.num_waiting == 1, "the request is queued")`). The timeout only stops a
test that would otherwise hang; it is long (HANG_TIMEOUT) so that a slow or loaded machine never
fails a test that is right, and it is never what a test asserts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_TIMEOUT = 30.0  # seconds; far beyond what any awaited condition takes, even on a loaded machine


def wait_until(condition: Callable[[], bool], what: str, timeout: float = HANG_TIMEOUT, interval: float = 0.02) -> None:
    """Poll `condition` (blocking) until it is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(interval)


async def async_wait_until(
    condition: Callable[[], bool], what: str, timeout: float = HANG_TIMEOUT, interval: float = 0.002
) -> None:
    """Like `wait_until`, yielding to the event loop between polls (other tasks run meanwhile)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        await asyncio.sleep(interval)
