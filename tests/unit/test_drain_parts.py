"""The drain's parts without a process: the state, the wait for open requests, the guard's refusal.
(tests/integration/test_drain.py drives a real process with real signals.)"""

from __future__ import annotations

import asyncio
import signal

import pytest
from starlette.applications import Starlette
from starlette.requests import Request

from lmiserve.config import Settings
from lmiserve.core.errors import ModelNotReady, ShuttingDown
from lmiserve.server.drain import Drain, wait_for_open_requests
from lmiserve.server.guard import Access, admit
from lmiserve.server.lifecycle import Lifecycle


def test_a_drain_begins_once_and_counts_down_from_its_start():
    drain = Drain()
    assert not drain.active and drain.remaining(10) == 10
    drain.begin()
    started = drain.started
    drain.begin()
    assert drain.active and drain.started == started
    assert 0 <= drain.remaining(10) <= 10
    assert drain.remaining(0) == 0


def test_shutting_down_is_answered_like_model_not_ready():
    assert issubclass(ShuttingDown, ModelNotReady)
    assert ShuttingDown().message == "The server is shutting down"


@pytest.mark.parametrize("stop", ["signal", "load failure"])
def test_every_stop_request_starts_the_drain(stop):
    lifecycle = Lifecycle()
    assert not lifecycle.drain.active
    if stop == "signal":
        lifecycle.on_signal(signal.SIGTERM, None)
    else:
        lifecycle.request_stop("model tiny failed to load")
    assert lifecycle.drain.active


async def test_the_wait_ends_when_the_requests_do():
    release = asyncio.Event()
    ticks = []

    async def tick() -> None:
        ticks.append(1)

    tasks = [asyncio.create_task(release.wait()) for _ in range(3)]
    waiting = asyncio.create_task(wait_for_open_requests(tasks, timeout=3600, tick=tick, interval=0.01))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    release.set()
    assert await waiting == 0
    assert ticks  # the Date header kept fresh meanwhile


async def test_the_wait_gives_up_at_the_timeout_and_counts_what_is_still_open():
    never = asyncio.Event()
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    open_ = [asyncio.create_task(never.wait()) for _ in range(2)]
    assert await wait_for_open_requests([done, *open_], timeout=0.05) == 2
    assert await wait_for_open_requests([done], timeout=3600) == 0  # nothing open: no wait
    for task in open_:
        task.cancel()


def _request(draining: bool) -> Request:
    app = Starlette()
    app.state.settings = Settings()
    app.state.drain = Drain()
    if draining:
        app.state.drain.begin()
    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b"", "app": app}
    return Request(scope)


@pytest.mark.parametrize("access", [Access.OPEN, Access.KEY])
def test_while_draining_the_guard_refuses_every_route_but_liveness(access):
    with pytest.raises(ShuttingDown):
        admit(_request(draining=True), access)
    admit(_request(draining=False), access)


def test_the_liveness_probe_passes_the_guard_while_draining():
    admit(_request(draining=True), Access.LIVE)
