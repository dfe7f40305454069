"""engine/runner/row_threads.py: a CPU step's row-by-row work over the engine's threads, each row once,
in the caller's modes, on one thread when the engine computes with one."""

from __future__ import annotations

import threading

import pytest
import torch

from lmiserve.engine.runner.row_threads import each_row


@pytest.fixture
def threads():
    def use(count: int) -> None:
        torch.set_num_threads(count)

    own = torch.get_num_threads()
    yield use
    torch.set_num_threads(own)


def test_each_row_runs_once_spread_over_the_threads_and_in_the_callers_inference_mode(threads):
    threads(2)
    seen: list[tuple[int, int]] = []
    rows = torch.zeros(40, 16)
    with torch.inference_mode():
        rows = torch.zeros(40, 16)  # an inference tensor: updated in place only in inference mode

        def work(j: int) -> None:
            rows[j].add_(j)  # the in-place update of an inference tensor
            seen.append((j, threading.get_ident()))

        each_row(work, 40)
    assert sorted(j for j, _ in seen) == list(range(40))
    assert rows[:, 0].tolist() == [float(j) for j in range(40)]
    assert len({ident for _, ident in seen}) == 2  # the caller and one worker
    assert torch.get_num_threads() == 2  # the caller's count, restored


@pytest.mark.parametrize("count", [1, 7])
def test_one_thread_or_few_rows_stay_on_the_caller(threads, count):
    """The governor's one thread (a busy machine) or too few rows to hand over: all on the calling thread."""
    threads(1 if count == 1 else 2)
    idents: set[int] = set()
    each_row(lambda j: idents.add(threading.get_ident()), 40 if count == 1 else count)
    assert idents == {threading.get_ident()}


def test_a_rows_error_is_raised_once_every_chunk_is_done(threads):
    threads(2)
    done: list[int] = []

    def work(j: int) -> None:
        if j == 35:
            raise ValueError("row 35")
        done.append(j)

    with pytest.raises(ValueError, match="row 35"):
        each_row(work, 40)
    assert sorted(done) == [j for j in range(40) if j not in range(35, 40)]
