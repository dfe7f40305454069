"""Steps whose sampled tokens are still on their way from the device (overlap scheduling on a GPU).

A decode step replayed from a CUDA graph has its rows' tokens picked or sampled inside the graph, their
top-N taken after it (engine/attention/cuda_graphs.py, runner/graph_sampling.py); for the rows the pick
serves (every row, or those the eager sampler does not take: runner/persistent_batch.py, `_graph_served`)
the runner starts their transfer to the host and returns (`Executor.launch`) without waiting. The engine
core launches the next step, whose rows may take those tokens as their inputs on the device, and only then
collects the first step (`Executor.collect`), so that the device runs from one step to the next while the
host catches up. Until a step is received, the runner's persistent batch lacks its tokens: a step that
needs them on the host (any step that is not such a chain) receives every step in flight first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmiserve.engine.core.step import SampleResult, StepOutput
from lmiserve.engine.runner.sampling import UNDRAWABLE

__all__ = ["InFlight", "PickTransfers", "StepsInFlight"]

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """One launched step's picks in flight: the output they complete, the sequences of its rows
    in order, and the call that waits for the picks (``[[token, logprob], ...]``, a row each; a sampled
    graph's with a third value: the row could not be drawn from; with `top_n`, each row's top-N tokens it
    asked for, of those after the third value: graph_sampling.with_top_n's ids, then their logprobs)."""

    out: StepOutput
    seq_ids: list[int]
    receive: Callable[[], list[list[float]]]
    top_n: list[int] | None = None
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

    def add(
        self,
        out: StepOutput,
        seq_ids: list[int],
        receive: Callable[[], list[list[float]]],
        top_n: list[int] | None = None,
    ) -> InFlight:
        step = InFlight(out, seq_ids, receive, top_n)
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
        for n, (seq_id, (token, logprob, *rest)) in enumerate(zip(step.seq_ids, picks, strict=True)):
            if rest and rest[0]:  # (a sampled graph's pick: sampling.sample_rows's error)
                step.out.errors[seq_id] = f"exception occurred during sampling: {UNDRAWABLE}"
                continue
            top = None
            if step.top_n is not None and step.top_n[n]:
                width = (len(rest) - 1) // 2  # the ids, then their logprobs, after the third value
                top = [(int(rest[1 + j]), rest[1 + width + j]) for j in range(min(step.top_n[n], width))]
            step.out.samples[seq_id] = [SampleResult(int(token), logprob, top)]
            self._apply(seq_id, int(token))


class PickTransfers:
    """A decode graph's picks on their way to the host: two pinned buffers of `size` values in turns (a step's
    picks may wait while the next step's are sent)."""

    def __init__(self, size: int, pinned: bool) -> None:
        self._host = [torch.zeros(size, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    def send(self, pick: torch.Tensor) -> Callable[[], list[list[float]]]:
        """Start the copy of `pick` (``[rows, columns]`` float64, on the device) to the host; the call that
        waits for it and gives its rows."""
        host = self._host[self._turn][: pick.numel()].view(pick.shape)  # contiguous: copied without a wait
        self._turn ^= 1
        host.copy_(pick, non_blocking=host.is_pinned())
        if pick.device.type != "cuda":
            return host.tolist
        arrived = torch.cuda.Event()  # type: ignore[no-untyped-call]
        arrived.record()

        def receive() -> list[list[float]]:
            arrived.synchronize()
            return host.tolist()

        return receive
