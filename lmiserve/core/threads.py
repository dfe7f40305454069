"""How many threads this process computes with, and how they wait: sized by what the process may use,
not by the host's cores.

`os.cpu_count()` is the host's CPU count. A container limited to 1 CPU on a 64-core host, or a process
pinned to two cores (`taskset`, Kubernetes' static CPU manager), that sizes torch's and numba's pools from
it runs many threads on few cores; at each barrier of an OpenMP region the threads that arrive first spin
for the ones still waiting for a core, and a decode step (hundreds of parallel regions) crawls. So the
thread count is the smallest of:

- the affinity mask (``os.sched_getaffinity``);
- the CPU quota of the process's cgroup: v2 ``cpu.max`` (``"100000 100000"`` = 1 CPU), v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the tightest of the cgroup and its ancestors, rounded
  down (at least 1);
- the physical cores among the allowed CPUs (SMT siblings share one core's arithmetic units);

unless the `num_threads` option, else ``OMP_NUM_THREADS``, names a count.

The wait policy: an OpenMP thread that reaches a barrier first spins (GNU OpenMP: 300,000 rounds by
default) before it sleeps. On an idle machine that saves a wake-up; on a shared one the spinning thread
holds the core the late thread needs. Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) costs a wake-up at
every one of a step's ~200 parallel regions (a 1-row int4 step 1.4-1.8x slower on the idle AMD EPYC). So
unless the user set ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME``, lmiserve sets
``GOMP_SPINCOUNT=10000``: a thread spins a few microseconds (a step's gaps between regions), then
sleeps. A neighbour that takes a core for good is `engine/cpu_threads.py`'s to handle (it lowers the
count while the neighbour runs). Measured in benchmarks/README.md ("Threads"). The environment is read
once, when OpenMP starts: `prepare_environment` must run before the first ``import torch`` of the
process; the engine applies the count (`engine.cpu_threads.apply`) any time.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
SYS_CPU = Path("/sys/devices/system/cpu")
SPIN_COUNT = "10000"  # GOMP_SPINCOUNT `prepare_environment` sets when the user chose no wait policy
OPTION_REASON, OMP_REASON = "the num_threads option", "OMP_NUM_THREADS"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count and why: `reason` is the log line's explanation."""

    threads: int
    reason: str
    wait_policy: str  # what OpenMP's waiting threads do ("GOMP_SPINCOUNT=10000", the user's setting, or "default")

    @property
    def given(self) -> bool:
        """Whether the user named the count (the option or OMP_NUM_THREADS): then it stays as given."""
        return self.reason in (OPTION_REASON, OMP_REASON)


def affinity_cpus() -> set[int] | None:
    """The CPUs this process may run on (its affinity mask); None where the platform does not say."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:  # pragma: no cover - macOS, Windows
        return None
    try:
        return set(getter(0))
    except OSError:  # pragma: no cover
        return None


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs the process's cgroup (and its ancestors) allow, as a fraction (1.5 = 150 ms a 100 ms
    period); None without a quota. Reads cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us``."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 (unified hierarchy)
            for directory in _up_to(root, path):
                limits.extend(_v2_limit(directory / "cpu.max"))
            unified = root / "unified"  # hybrid mounts: v2 at /sys/fs/cgroup/unified
            for directory in _up_to(unified, path) if unified.is_dir() else []:
                limits.extend(_v2_limit(directory / "cpu.max"))
        elif "cpu" in controllers.split(","):
            mount = next((root / n for n in (controllers, "cpu", "cpu,cpuacct") if (root / n).is_dir()), None)
            for directory in _up_to(mount, path) if mount is not None else []:
                limits.extend(_v1_limit(directory))
    return min(limits) if limits else None


def _up_to(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of `path` under `mount` and its ancestors up to the mount (inside a container
    whose cgroup namespace hides the path, the mount itself is the container's cgroup)."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_limit(cpu_max: Path) -> list[float]:
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
    except OSError:
        return []
    if quota == "max" or not quota:
        return []
    try:
        return [int(quota) / int(period or "100000")]
    except (ValueError, ZeroDivisionError):
        return []


def _v1_limit(directory: Path) -> list[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def physical_cores(cpus: set[int] | None, sys_cpu: Path = SYS_CPU) -> int | None:
    """Physical cores among `cpus` (their distinct SMT sibling sets); None when sysfs does not say."""
    if not cpus:
        return None
    cores: set[str] = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        for name in ("core_cpus_list", "thread_siblings_list"):
            with contextlib.suppress(OSError):
                cores.add((topology / name).read_text().strip())
                break
        else:
            return None
    return len(cores) or None


def choose(
    option: int | None = None,
    env: Mapping[str, str] | None = None,
    *,
    cpus: set[int] | None = None,
    quota: float | None = None,
    cores: int | None = None,
    detect: bool = True,
) -> ThreadChoice:
    """The thread count: `option` (the `num_threads` setting; 0 or None = choose), else ``OMP_NUM_THREADS``,
    else the smallest of the affinity mask, the cgroup quota and the physical cores. `cpus`, `quota`,
    `cores` replace what is read from this machine (tests); `detect=False` reads nothing."""
    env = os.environ if env is None else env
    wait = next((f"{k}={env[k]}" for k in WAIT_VARIABLES if env.get(k)), "default")
    if option:
        return ThreadChoice(option, OPTION_REASON, wait)
    omp = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), OMP_REASON, wait)
    if detect:
        cpus = affinity_cpus() if cpus is None else cpus
        quota = cgroup_quota() if quota is None else quota
        cores = physical_cores(cpus) if cores is None else cores
    bounds: list[tuple[int, str]] = []
    if cpus:
        bounds.append((len(cpus), f"{len(cpus)} CPUs in the affinity mask"))
    if quota is not None:
        bounds.append((max(1, math.floor(quota + 1e-9)), f"a cgroup quota of {quota:g} CPUs"))
    if cores:
        bounds.append((cores, f"{cores} physical cores"))
    if not bounds:
        count = os.cpu_count() or 1
        return ThreadChoice(count, f"{count} CPUs (os.cpu_count; nothing else known)", wait)
    threads = min(b[0] for b in bounds)
    texts = [text for _, text in bounds] + (["no cgroup CPU quota"] if quota is None else [])
    reason = "the smallest of: " + ", ".join(texts)
    return ThreadChoice(threads, reason, wait)


def prepare_environment(choice: ThreadChoice, env: MutableMapping[str, str] | None = None) -> ThreadChoice:
    """Before torch and numba are imported: OpenMP's and numba's thread counts, and a bounded spin
    (`SPIN_COUNT`) unless the user chose a wait policy. Returns the choice with the wait policy it set (when torch was
    imported already, the wait policy can no longer change and the returned choice says so)."""
    global _prepared
    env = os.environ if env is None else env
    count = str(choice.threads)
    env["OMP_NUM_THREADS"] = count
    for name in ("MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):  # numba starts this many (not the host's count)
        env.setdefault(name, count)
    if choice.wait_policy == "default":
        if "torch" in sys.modules and env is os.environ:
            choice = ThreadChoice(choice.threads, choice.reason, "default (torch was imported before it could be set)")
        else:
            env["GOMP_SPINCOUNT"] = SPIN_COUNT
            choice = ThreadChoice(choice.threads, choice.reason, f"GOMP_SPINCOUNT={SPIN_COUNT}")
    if env is os.environ:
        _prepared = choice
    return choice


_prepared: ThreadChoice | None = None  # what `prepare_environment` set in this process's environment


def prepared(option: int | None = None) -> ThreadChoice:
    """The choice `prepare_environment` made earlier in this process for this `option`, else a new one
    prepared now (what `lmiserve serve` applies and logs once logging is set up)."""
    global _prepared
    earlier, _prepared = _prepared, None
    if earlier is not None and (not option or earlier.threads == option):
        return earlier
    choice = prepare_environment(choose(option))
    _prepared = None
    return choice
