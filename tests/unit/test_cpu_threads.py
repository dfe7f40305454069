"""The engine's thread governor (engine/cpu_threads.py): fewer threads while other processes take the
allowed CPUs, back when they stop; two looks in a row must agree."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from lmiserve.engine import cpu_threads
from lmiserve.engine.cpu_threads import ThreadGovernor


class Machine:
    """A clock, the busy CPU seconds of the allowed CPUs and this process's own CPU seconds."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.applied: list[int] = []

    def advance(self, seconds: float, others: float, ours: float = 2.0) -> None:
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.own += ours * seconds

    def governor(self, budget: int = 2, cpus: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            budget,
            set(range(cpus)),
            busy=lambda: self.busy,
            own=lambda: self.own,
            clock=lambda: self.now,
            set_threads=self.applied.append,
        )


def test_a_neighbour_on_one_of_two_cpus_takes_a_thread_and_gives_it_back():
    machine = Machine()
    governor = machine.governor()
    assert governor.tick() == 2  # the first look only reads
    machine.advance(0.6, others=1.0, ours=1.0)
    assert governor.tick() == 2  # one look: pending
    machine.advance(0.6, others=1.0, ours=1.0)
    assert governor.tick() == 1 and machine.applied == [1]
    machine.advance(0.6, others=0.05, ours=1.0)
    assert governor.tick() == 1
    machine.advance(0.6, others=0.05, ours=1.0)
    assert governor.tick() == 2 and machine.applied == [1, 2]


def test_a_burst_does_not_flip_the_count():
    machine = Machine()
    governor = machine.governor()
    governor.tick()
    for others in (1.0, 0.0, 1.0, 0.0):
        machine.advance(0.6, others=others)
        assert governor.tick() == 2
    assert machine.applied == []


def test_looks_are_spaced_and_our_own_spinning_is_not_a_neighbour():
    machine = Machine()
    governor = machine.governor()
    governor.tick()
    machine.advance(0.1, others=2.0)
    governor.tick()
    machine.advance(0.1, others=2.0)
    assert governor.tick() == 2  # within PERIOD_S of the first look: not looked again
    machine = Machine()
    governor = machine.governor()
    governor.tick()
    for _ in range(3):
        machine.advance(0.6, others=0.0, ours=2.0)  # both our threads busy (spinning included)
        assert governor.tick() == 2


def test_never_below_one_or_above_the_start_up_count():
    machine = Machine()
    governor = machine.governor(budget=4, cpus=8)
    governor.tick()
    for _ in range(2):
        machine.advance(0.6, others=7.9, ours=0.1)
        governor.tick()
    assert governor.threads == 1
    for _ in range(2):
        machine.advance(0.6, others=0.0, ours=0.1)
        governor.tick()
    assert governor.threads == 4  # 8 CPUs free, but the start chose 4


def test_busy_seconds_read_only_the_allowed_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  30 0 0 900 0 0 0 0 0 0\ncpu0 10 1 2 300 50 3 4 5 0 0\ncpu1 100 0 0 300 0 0 0 0 0 0\nintr 1 2 3\n"
    )
    hz = os.sysconf("SC_CLK_TCK")
    assert cpu_threads.busy_seconds({0}, stat) == pytest.approx((10 + 1 + 2 + 3 + 4 + 5) / hz)  # not idle, iowait
    assert cpu_threads.busy_seconds({0, 1}, stat) == pytest.approx(125 / hz)
    assert cpu_threads.busy_seconds({0}, tmp_path / "missing") is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_a_real_spinning_neighbour_is_seen_on_proc_stat():
    cpu = max(os.sched_getaffinity(0))
    governor = ThreadGovernor(2, set(os.sched_getaffinity(0)), set_threads=lambda n: None)
    spinner = subprocess.Popen(["taskset", "-c", str(cpu), "sh", "-c", "while :; do :; done"])
    try:
        time.sleep(0.2)
        governor.neighbours()
        time.sleep(1.0)
        others = governor.neighbours()
    finally:
        spinner.kill()
        spinner.wait()
    assert others is not None and others >= 0.5  # the spinner (and whatever else runs) on the allowed CPUs
