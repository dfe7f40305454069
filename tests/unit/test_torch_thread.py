"""All serving torch work runs on one long-lived thread; loads run apart on a thread that ends."""

from __future__ import annotations

import threading

import pytest

from lmiserve.engine import torch_thread


async def test_run_uses_one_thread_that_is_not_the_event_loop():
    names = {await torch_thread.run(lambda: threading.current_thread().name) for _ in range(5)}
    assert len(names) == 1 and names != {threading.current_thread().name}
    assert await torch_thread.run(lambda a, b=0: a + b, 2, b=3) == 5


async def test_run_apart_returns_and_raises_and_its_thread_ends():
    seen = {}

    def load():
        seen["thread"] = threading.current_thread()
        return "loaded"

    assert await torch_thread.run_apart(load) == "loaded"
    seen["thread"].join(timeout=5)
    assert not seen["thread"].is_alive()
    with pytest.raises(ValueError, match="bad weights"):
        await torch_thread.run_apart(lambda: (_ for _ in ()).throw(ValueError("bad weights")))
