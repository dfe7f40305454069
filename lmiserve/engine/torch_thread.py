"""One long-lived worker thread for the torch work of serving (engine steps and
one-shot forwards), so the event loop stays free and the CPU thread pool is built once. Models load
on a thread of their own that ends with the load (`run_apart`).

Why one thread and not `asyncio.to_thread`: each OS thread that runs torch ops gets its own OpenMP
team, and the idle team of another live thread competes with it for the cores. Measured on 2 CPU
cores with SmolLM2-135M at batch 1: a decode step takes 26 ms on the thread that loaded the model and
53-75 ms on any other executor thread; on this one thread it takes 26 ms.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar, TypeVarTuple, Unpack

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Ts = TypeVarTuple("_Ts")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmiserve-torch")


async def run(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """`await run(fn, ...)`: `fn(...)` on the torch thread (torch work queues there in call order)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(fn, *args, **kwargs))


async def run_apart(fn: Callable[[Unpack[_Ts]], _R], *args: *_Ts) -> _R:
    """`fn(*args)` on a new thread that ends with it (model loading): a load never holds up the steps
    queued on the torch thread, and its CPU thread pool goes away with the thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_R] = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_reject, future, exc)
        else:
            loop.call_soon_threadsafe(_resolve, future, result)

    threading.Thread(target=target, name="lmiserve-load", daemon=True).start()
    return await future


def _resolve(future: asyncio.Future[_R], result: _R) -> None:
    if not future.cancelled():
        future.set_result(result)


def _reject(future: asyncio.Future[_R], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)
