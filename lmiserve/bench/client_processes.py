"""A level's closed-loop clients in one process or split over several (`lmiserve bench --client-processes N`).

One asyncio process reads every stream of a level, and httpx costs about 115 us of CPU a streamed token (a
2-core AMD EPYC), so one process reads at most ~8,700 tokens/s there: near what a GPU server streams at 128
clients. With N processes, process n runs the level's clients c with c % N == n (their prompts and warm-up
stagger are those they have in one process); the processes are spawned (the bench process may hold torch and
its threads), import, wait for each other at a barrier, run, and send their records back to be merged.
`time.perf_counter` is the system's monotonic clock on Linux, so records from different processes compare,
and the level's window and figures come from the merged records as from one process's. With `--duration`,
each process's measured time starts when its own clients ended their warm-ups.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from lmiserve.bench.clients import BenchError
from lmiserve.bench.prompts import active_prompt_set, select_prompt_set
from lmiserve.bench.stats import RequestRecord

LevelRun = Callable[..., Coroutine[Any, Any, tuple[list[RequestRecord], float]]]
START_TIMEOUT = 300.0  # seconds for every process to start and import (a hang guard)


@dataclass
class ClientRun:
    """What a level's clients did: their records, the level's wall time, the clients' CPU seconds and the
    busiest client process's share of one core (near 1: that process may have been the limit)."""

    records: list[RequestRecord]
    elapsed: float
    cpu: float
    busy: float


def _share(cpu: float, elapsed: float) -> float:
    return cpu / elapsed if elapsed > 0 else 0.0


def run_clients(run: LevelRun, processes: int, *args: Any, **kwargs: Any) -> ClientRun:
    """`run(*args, **kwargs)` (`run_level`, `run_chat_level`) here, or over `processes` processes, each
    passed ``share=(n, processes)``; a process that fails or dies fails the bench (BenchError)."""
    if processes <= 1:
        records, elapsed, cpu, window = _timed(run, args, kwargs)
        return ClientRun(records, elapsed, cpu, _share(cpu, window))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(
            target=_client_process,
            args=(n, processes, barrier, results, active_prompt_set(), run, args, kwargs),
            name=f"lmiserve-bench-clients-{n}",
            daemon=True,
        )
        for n in range(processes)
    ]
    for worker in workers:
        worker.start()
    got: dict[int, tuple[list[RequestRecord], float, float, float]] = {}
    try:
        while len(got) < processes:
            try:
                n, outcome = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w.name for k, w in enumerate(workers) if k not in got and w.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(f"client process {dead[0]} died without its records") from None
                continue
            if isinstance(outcome, str):
                raise BenchError(f"client process {n} of {processes} failed: {outcome}")
            got[n] = outcome
    finally:
        for worker in workers:
            worker.join(timeout=10.0)
            if worker.is_alive():
                worker.kill()
    records = sorted((r for part, *_ in got.values() for r in part), key=lambda r: (r.client, r.index))
    return ClientRun(
        records,
        max(elapsed for _, elapsed, _, _ in got.values()),
        sum(cpu for _, _, cpu, _ in got.values()),
        max(_share(cpu, window) for _, _, cpu, window in got.values()),
    )


def _timed(
    run: LevelRun, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[RequestRecord], float, float, float]:
    """`run`'s records and wall time (its clients' window), the CPU seconds this process used for it and the
    wall time they were used in (the window with the clients' set-up: a process's share of a core is CPU over
    the same time; over the window alone a short level showed more than one core)."""
    cpu, start = time.process_time(), time.perf_counter()
    records, elapsed = asyncio.run(run(*args, **kwargs))
    return records, elapsed, time.process_time() - cpu, time.perf_counter() - start


def _client_process(
    n: int,
    processes: int,
    barrier: Any,
    results: Any,
    prompt_set: str,
    run: LevelRun,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Process `n`: its share of the clients, started with the others; ``(n, (records, elapsed, cpu, wall))``
    or ``(n, "what failed")`` on `results`."""
    try:
        select_prompt_set(prompt_set)
        barrier.wait(timeout=START_TIMEOUT)
        results.put((n, _timed(run, args, {**kwargs, "share": (n, processes)})))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it as a BenchError
        results.put((n, f"{type(exc).__name__}: {exc}"[:500]))
