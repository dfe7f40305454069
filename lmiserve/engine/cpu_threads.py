"""The CPU thread count the engine computes with: set (`apply`) and, while other processes take cores,
lowered (`ThreadGovernor`).

The start-up choice (`lmiserve.core.threads`: affinity mask, cgroup quota, physical cores) says what the
process may use; it cannot know what its neighbours will take. When a neighbour keeps one of two
cores busy, two threads meet at every barrier of a step's ~200 parallel regions with one of them
waiting for a core the scheduler hands out in milliseconds: a 1-row int4 step on the AMD EPYC went from
12 ms to 40-100 ms, where one thread ran it in 13-14 ms. So the governor, ticked before each piece of
torch work on the CPU thread (engine/torch_thread.py), at most every `PERIOD_S` reads how much of the
allowed CPUs the other processes used since the last look (``/proc/stat`` for those CPUs, less this
process's own CPU time, spinning included) and runs with what is left, rounded, between 1 and the
start-up count; a change needs two looks in a row that agree (a compile or a burst does not flip it).
Both torch's count and numba's are per thread: `apply` runs on the thread that computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PERIOD_S = 0.5  # how often the governor looks at the neighbours
PROC_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guest is within user)


def apply(threads: int) -> None:
    """Torch's intra-op threads and numba's (the compiled kernels') on the calling thread."""
    torch.set_num_threads(threads)
    with contextlib.suppress(ImportError, ValueError):
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]


def busy_seconds(cpus: set[int], stat: Path = PROC_STAT) -> float | None:
    """CPU seconds spent busy (anything but idle and iowait) on `cpus` since boot; None if unknown."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = rest.split()
        ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    """Runs with the cores the neighbours leave: `tick()` before each piece of CPU work."""

    def __init__(
        self,
        budget: int,
        cpus: set[int],
        *,
        busy: Callable[[], float | None] | None = None,
        own: Callable[[], float] = own_seconds,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = apply,
    ) -> None:
        self.budget = budget
        self.threads = budget
        self._cpus = cpus
        self._busy = busy if busy is not None else lambda: busy_seconds(cpus)
        self._own, self._clock, self._set = own, clock, set_threads
        self._last: tuple[float, float, float] | None = None
        self._pending: int | None = None

    @classmethod
    def for_this_process(cls) -> ThreadGovernor | None:
        """A governor over this process's allowed CPUs at torch's current count; None where there is
        nothing to govern (one thread) or no ``/proc/stat``."""
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        budget = torch.get_num_threads()
        if budget < 2 or not cpus or busy_seconds(cpus) is None:
            return None
        return cls(budget, cpus)

    def neighbours(self) -> float | None:
        """CPUs the other processes used since the last look (the first look: None)."""
        now, busy, own = self._clock(), self._busy(), self._own()
        if busy is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return None
        return max(0.0, ((busy - last[1]) - (own - last[2])) / (now - last[0]))

    def tick(self) -> int:
        """Look (at most every `PERIOD_S`) and change the count when two looks in a row agree."""
        if self._last is not None and self._clock() - self._last[0] < PERIOD_S:
            return self.threads
        others = self.neighbours()
        if others is None:
            return self.threads
        target = max(1, min(self.budget, int(len(self._cpus) - others + 0.5)))
        if target == self.threads:
            self._pending = None
        elif self._pending == target:
            log.info(
                "threads: %d -> %d (other processes use %.1f of the %d CPUs this process may run on)",
                self.threads,
                target,
                others,
                len(self._cpus),
            )
            self._set(target)
            self.threads, self._pending = target, None
        else:
            self._pending = target
        return self.threads
