"""A tensor-parallel worker's step loop (engine/executors/tp_worker.py): rank 0 receives each message from the leader
(engine/executors/tensor_parallel.py) and broadcasts it to every rank over the gloo group; every rank runs it; rank 0
answers each batch with its `StepOutput`, in the order the batches came.

Overlap scheduling over the ranks: the leader sends a batch as soon as the engine plans it, without waiting for the
answer to the one before (`TensorParallelExecutor.launch`). A step whose sampled tokens are still on their way from the
device (`Launched.pending`: a decode graph's pick) is answered only once rank 0 has seen whether the next batch comes
first: while the device runs the step, rank 0 watches the leader's pipe, and a batch that arrives then is launched
behind the step before its answer (taking the step's tokens as its rows' inputs on the device where it chains:
runner/in_flight.py), so the devices run from one step to the next while the host pickles, sends and plans. Every
rank learns with the batch whether rank 0 received the step before it first, and does the same, so that every rank's
runner chains (or not) alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from lmiserve.engine.core.step import Launched, StepOutput

__all__ = ["StepCounts", "run_batches"]

log = logging.getLogger(__name__)

WATCH_S = 0.0001  # how long rank 0 waits for the leader's pipe at a time while a step runs on the device
GAP_S = 0.05  # a wait for the leader's next step this long or longer is the server idling, not a gap between steps


@dataclass
class StepCounts:
    """Rank 0's account of its steps, logged when the leader stops the workers: the steps, those launched behind the
    step before them while it ran on the device, and the gaps: rank 0 waiting for the leader's next step with none
    in flight, each shorter than `GAP_S` (longer ones are the server idling), the time overlap scheduling takes out
    from between steps."""

    steps: int = 0
    behind: int = 0
    gaps: int = 0
    gap_s: float = 0.0

    def waited(self, seconds: float) -> None:
        if seconds < GAP_S:
            self.gaps += 1
            self.gap_s += seconds

    def line(self) -> str:
        share = self.behind / self.steps if self.steps else 0.0
        gap = 1000 * self.gap_s / self.gaps if self.gaps else 0.0
        return (
            f"{self.steps} steps, {self.behind} ({share:.0%}) launched behind the step before them on the device; "
            f"{self.gaps} waits for the leader with no step in flight, {gap:.3f} ms each on average"
        )


def run_batches(runner: Any, rank: int, conn: Connection | None, control: Any) -> StepCounts:
    """Run the leader's messages until it says stop (None) or goes: steps (``("step", batch, awaited)``: a
    `StepBatch`, and whether the leader awaits its answer before it sends anything more, `Executor.execute`, or may
    send the next step first, `Executor.launch`) and the masks of the rows the last step held (``("masks", rows,
    bitmask)``: `Executor.sample_masked`). `runner`: a rank's `PersistentBatchRunner`; `conn`: rank 0's pipe to the
    leader (None on the other ranks); `control`: the group the messages are broadcast over. Rank 0's counts
    (`StepCounts`, logged) are returned."""
    import torch.distributed as dist

    counts = StepCounts()

    unanswered: Launched | None = None  # the last step launched, its tokens still on their way from the device
    while True:
        box: list[Any] = [None, False]  # the message, and whether rank 0 received the step before it first
        if rank == 0:
            assert conn is not None
            if unanswered is not None and not _next_comes_first(conn, runner.device):
                _answer(conn, runner.collect(unanswered))  # (the leader may be waiting for it)
                unanswered, box[1] = None, True
            waiting = unanswered is None and not conn.poll(0)
            started = time.perf_counter()
            with contextlib.suppress(EOFError, OSError):
                box[0] = conn.recv()
            if waiting:
                counts.waited(time.perf_counter() - started)
        dist.broadcast_object_list(box, src=0, group=control)
        message, received_first = box
        if unanswered is not None and (received_first or not _is_batch(message)):  # (as rank 0 did)
            _answer(conn, runner.collect(unanswered))
            unanswered = None
        if message is None:
            if rank == 0:
                log.info("rank 0: %s", counts.line())
            return counts
        if not _is_batch(message):  # the masks of the rows the last batch held
            _answer(conn, runner.sample_masked(*message[1:]))
            continue
        _, batch, awaited = message
        launched = runner.launch_batch(batch)
        counts.steps += bool(batch.rows)  # (not a heartbeat's empty batch)
        counts.behind += unanswered is not None
        if unanswered is not None:  # (launched behind it on the device: now its answer)
            _answer(conn, runner.collect(unanswered))
        unanswered = None
        if launched.pending is None or awaited:  # (the leader sends nothing more until it has this answer)
            _answer(conn, runner.collect(launched))
        else:
            unanswered = launched


def _is_batch(message: Any) -> bool:
    return message is not None and message[0] == "step"


def _next_comes_first(conn: Connection, device: torch.device) -> bool:
    """Whether the leader's next message arrives before the device has run what it was given (then rank 0 launches
    it behind that step); False at once on a CPU with nothing waiting (its step ran when it was launched)."""
    if conn.poll(0):
        return True
    if device.type != "cuda":
        return False
    stream = torch.cuda.current_stream(device)
    while not stream.query():
        if conn.poll(WATCH_S):
            return True
    return False


def _answer(conn: Connection | None, output: StepOutput) -> None:
    """Rank 0's answer to the leader (the other ranks answer nothing). A leader that has gone (it closed the pipe
    with steps unanswered) is not an error: the next receive ends the loop."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.send(("ok", output))
