"""Steps whose sampled tokens are still on their way from the device (overlap scheduling on a GPU).

A decode step replayed from a CUDA graph whose rows all sample greedily has its tokens picked inside the
graph (engine/attention/cuda_graphs.py); the runner starts their transfer to the host and returns
(`Executor.launch`) without waiting. The engine core launches the next step, whose rows may take those
tokens as their inputs on the device, and only then collects the first step (`Executor.collect`), so
that the device runs from one step to the next while the host catches up. Until a step is received,
the runner's persistent batch lacks its tokens: a step that needs them on the host (any step that is not
such a chain) receives every step in flight first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from lmiserve.engine.core.step import SampleResult, StepOutput

__all__ = ["InFlight", "StepsInFlight"]

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """One launched step's greedy picks in flight: the output they complete, the sequences of its rows
    in order, and the call that waits for the picks (``[[token, logprob], ...]``, a row each)."""

    out: StepOutput
    seq_ids: list[int]
    receive: Callable[[], list[list[float]]]
    done: bool = False


class StepsInFlight:
    """The launched steps whose picks have not been received, oldest first. `apply(seq_id, token)` adds
    a received token to the persistent batch (in the order the steps ran)."""

    def __init__(self, apply: Callable[[int, int], None]) -> None:
        self._steps: list[InFlight] = []
        self._apply = apply

    @property
    def last(self) -> InFlight | None:
        return self._steps[-1] if self._steps else None

    def add(self, out: StepOutput, seq_ids: list[int], receive: Callable[[], list[list[float]]]) -> InFlight:
        step = InFlight(out, seq_ids, receive)
        self._steps.append(step)
        return step

    def receive(self, upto: InFlight | None = None, keep_last: bool = False) -> None:
        """Wait for the steps in flight, in order: up to `upto` (included), or all but the last with
        `keep_last`, or all."""
        if upto is not None and upto.done:
            return
        while self._steps and not (keep_last and len(self._steps) == 1):
            step = self._steps.pop(0)
            self._receive(step)
            if step is upto:
                return

    def _receive(self, step: InFlight) -> None:
        step.done = True
        try:
            picks = step.receive()
        except Exception as exc:  # noqa: BLE001 - the step's rows fail, the engine goes on
            log.exception("receiving a step's sampled tokens failed")
            for seq_id in step.seq_ids:
                step.out.errors[seq_id] = f"exception occurred during sampling: {exc}"
            return
        for seq_id, (token, logprob) in zip(step.seq_ids, picks, strict=True):
            step.out.samples[seq_id] = [SampleResult(int(token), logprob)]
            self._apply(seq_id, int(token))
