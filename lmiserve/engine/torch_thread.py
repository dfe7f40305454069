"""Long-lived worker threads for the torch work of serving (engine steps and one-shot forwards), so
the event loop stays free. Models load on a thread of their own that ends with the load (`run_apart`).

`for_device`: the models on the CPU share ONE thread (`run`), so the CPU thread pool is built once;
a model on a GPU gets a thread of its own, so one model's forward (an embedding batch) never queues
behind another's (an LLM step): the GPU runs them side by side while the host threads wait.

Why one thread on the CPU and not `asyncio.to_thread` or a thread a model: each OS thread that runs
torch ops gets its own OpenMP team, and the idle team of another live thread competes with it for the
cores. Measured on 2 CPU cores with SmolLM2-135M at batch 1: a decode step takes 26 ms on the thread
that loaded the model and 53-75 ms on any other executor thread; on this one thread it takes 26 ms.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar, TypeVarTuple, Unpack

import torch

from lmiserve.engine.cpu_threads import ThreadGovernor

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Ts = TypeVarTuple("_Ts")


class TorchThread:
    """One worker thread: the torch work handed to it runs there in call order. `governed`: its thread
    count follows what other processes leave of the CPUs (`cpu_threads.ThreadGovernor`, while `GOVERN`)."""

    def __init__(self, name: str, governed: bool = False) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._governed = governed
        self._governor: ThreadGovernor | None = None
        self._looked = False

    async def run(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """`await thread.run(fn, ...)`: `fn(...)` on this thread (started on first use, again after `close`)."""
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> asyncio.Future[_R]:
        """Queue `fn(...)` on this thread now (behind the calls queued before it) and return its future,
        so that the caller goes on meanwhile (the engine core plans a step while the one before it runs)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        if self._governed and GOVERN:
            call = functools.partial(self._governed_call, call)
        return loop.run_in_executor(self._executor, call)

    def _governed_call(self, call: Callable[[], _R]) -> _R:
        if not self._looked:  # on this thread: torch's and numba's counts are per thread
            self._governor, self._looked = ThreadGovernor.for_this_process(), True
        if self._governor is not None:
            self._governor.tick()
        return call()

    def close(self) -> None:
        """End the thread once the work handed to it is done (never the shared CPU thread)."""
        if self is not SHARED and self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


GOVERN = True  # False: the thread count stays what the start chose (`num_threads` or OMP_NUM_THREADS given)
SHARED = TorchThread("lmiserve-torch", governed=True)  # every model on the CPU


def for_device(device: torch.device | str, name: str) -> TorchThread:
    """The thread for a model on `device`: the shared one on the CPU, one of its own (`name`) else."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return SHARED if kind == "cpu" else TorchThread(f"lmiserve-torch-{name}")


async def run(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """`await run(fn, ...)`: `fn(...)` on the shared torch thread."""
    return await SHARED.run(fn, *args, **kwargs)


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
