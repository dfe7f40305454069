"""The grammar masks of a step's constrained rows (engine/text/token_mask.py), filled on the torch thread from
their sequences' matchers: when the step is launched or, for a step planned while the step before it ran
(overlap scheduling, `StepBatch.mask_later`), once that step's tokens are applied; the executor then samples
the rows it held back (`Executor.sample_masked`). So a grammar's mask always follows the token before it,
and the model's forward of the next step runs while the host applies this one."""

from __future__ import annotations

import logging

import numpy as np

from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.step import Executor, ExecutorFailed, StepOutput
from lmiserve.engine.text.token_mask import TokenMask

__all__ = ["StepMasks", "add_held", "fail_rows"]

log = logging.getLogger(__name__)


class StepMasks:
    """The engine core's bitmask of a step's constrained rows (its buffer made on the first grammar)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._mask: TokenMask | None = None

    def fill(self, plan: StepPlan, rows: list[int]) -> tuple[np.ndarray | None, dict[int, str]]:
        """The bitmask of `plan`'s rows `rows` (indexes into its batch), a row each from its sequence's
        matcher as it stands; when that fails, None and the error of each of their sequences."""
        if not rows:
            return None, {}
        seqs = plan.seqs
        try:
            if self._mask is None:
                self._mask = TokenMask(self.executor.vocab_size, self.executor.eos_token_ids)
            matchers = [seqs[i].grammar for i in rows]
            return self._mask.fill([m for m in matchers if m is not None]).numpy().copy(), {}
        except Exception as exc:  # noqa: BLE001 - the constrained rows fail, the others go on
            log.exception("filling the grammar bitmask failed")
            return None, {seqs[i].seq_id: f"exception occurred during sampling: {exc}" for i in rows}

    @staticmethod
    def masked_now(plan: StepPlan) -> list[int]:
        """A `mask_later` step's rows to mask now that the step before it is applied: those of a sequence that
        goes on with a matcher (one that ended with that step's token has its token here dropped; one still
        waiting for its grammar's marker, or thinking within its budget, samples unmasked)."""
        seqs = plan.seqs
        return [i for i in plan.batch.grammar_rows if not seqs[i].finished and seqs[i].grammar is not None]

    def sample_held(self, plan: StepPlan) -> StepOutput:
        """A `mask_later` step's held rows sampled (on the torch thread, once the step before it is applied),
        masked from their matchers as they stand now: their samples and errors, which `add_held` adds to
        the step's output (a row whose mask failed was sampled unmasked: its token is dropped)."""
        rows = self.masked_now(plan)
        bitmask, failed = self.fill(plan, rows)
        try:
            held = self.executor.sample_masked([] if failed else rows, bitmask)
        except ExecutorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the held rows fail, the step's others go on
            log.exception("sampling the constrained rows failed")
            seqs = plan.seqs
            held = StepOutput()
            failed = {seqs[i].seq_id: f"exception occurred during sampling: {exc}" for i in plan.batch.grammar_rows}
        fail_rows(held, failed)
        return held


def add_held(output: StepOutput, held: StepOutput) -> None:
    """A step's output completed by its held rows' (`sample_held`): their samples, but of a sequence the
    step failed, and their errors."""
    output.samples.update({seq_id: s for seq_id, s in held.samples.items() if seq_id not in output.errors})
    fail_rows(output, held.errors)


def fail_rows(output: StepOutput, failed: dict[int, str]) -> None:
    """The rows in `failed` (whose mask failed) failed: their tokens, sampled unmasked, dropped."""
    for seq_id, message in failed.items():
        output.samples.pop(seq_id, None)
        output.errors[seq_id] = message
