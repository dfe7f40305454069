"""A CPU step's row-by-row sampling work spread over the threads the engine computes with (issue #39).

Some of a step's sampling is one op a row that torch runs on one thread: each sampled row's exponential
variates drawn with its own generator (a seeded row must draw what it draws alone), and a CPU's `top_p` of
a row. On a CPU they add up: 128 sampled rows of SmolLM2's 49,152 tokens spend ~165 ms a step drawing
alone. `each_row` runs ``work(j)`` for every row in contiguous chunks, one a thread: the calling thread
takes the first, the others go to a few worker threads (started on first use, blocked on their queue
when idle: nothing spins). How many threads is the calling thread's torch count, which the engine sets and
its governor lowers while neighbours take the cores (engine/cpu_threads.py), so a busy machine runs the
rows on one. Every thread computes its chunk with one torch thread, so the chunks never oversubscribe
the cores. The ops release the GIL while they compute; the workers compute in the caller's inference and
grad modes (the engine's step runs in inference mode, and modes are per thread). Each row's result is
what it is on one thread: its generator is its own, and its values do not depend on the thread that draws
them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["each_row"]

MIN_ROWS = 4  # fewer rows: not worth a hand-over (a few µs each)
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_workers = 0


def _one_thread() -> None:
    torch.set_num_threads(1)


def _helpers(count: int) -> ThreadPoolExecutor:
    """At least `count` worker threads, each computing with one torch thread."""
    global _pool, _workers
    with _lock:
        if _pool is None or _workers < count:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(count, thread_name_prefix="lmiserve-rows", initializer=_one_thread)
            _workers = count
        return _pool


def _chunk(work: Callable[[int], object], start: int, end: int) -> None:
    for j in range(start, end):
        work(j)


def _worker_chunk(work: Callable[[int], object], start: int, end: int, inference: bool, grad: bool) -> None:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):  # the caller's (they are per thread)
        _chunk(work, start, end)


def each_row(work: Callable[[int], object], count: int) -> None:
    """``work(j)`` for ``j`` in ``range(count)``, each exactly once, over the calling thread's torch thread
    count (see the module's doc); returns once all are done, raising the first chunk's error."""
    own = torch.get_num_threads()
    threads = min(own, count // MIN_ROWS)
    if threads <= 1:
        _chunk(work, 0, count)
        return
    bounds = [count * t // threads for t in range(threads + 1)]
    pool = _helpers(threads - 1)
    modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    futures = [pool.submit(_worker_chunk, work, bounds[t], bounds[t + 1], *modes) for t in range(1, threads)]
    torch.set_num_threads(1)
    try:
        _chunk(work, bounds[0], bounds[1])
    finally:
        torch.set_num_threads(own)
        for future in futures:
            future.exception()  # every chunk ended before the rows are read
    for future in futures:
        future.result()
