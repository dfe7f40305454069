"""What the executor has been told of the requests (its persistent batch, engine/core/step.py), so that each
step's plan goes out as plain data by difference: the requests new to it, the blocks each table gained since
its last step, the requests that left or were preempted. The block scheduler (engine/core/block_scheduler.py)
owns one.
"""

from __future__ import annotations

from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.sequence import Sequence
from lmiserve.engine.core.step import PENDING_TOKEN, NewRequest, ScheduledTokens, StepBatch
from lmiserve.engine.speculative.proposers import SpeculationPolicy


class ExecutorView:
    """The executor's side of the running requests, as the scheduler last described it."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # seq_id -> blocks of its table the executor has been told of
        self._preempted: list[int] = []  # preempted since the last batch, known to the executor

    def preempted(self, seq: Sequence) -> None:
        """`seq` gave its blocks back: the next batch says so, and sends its table again from the start."""
        if seq.seq_id in self._sent:
            self._sent[seq.seq_id] = 0
            self._preempted.append(seq.seq_id)

    def batch(self, plan: StepPlan, speculation: SpeculationPolicy | None, masks_later: bool = False) -> StepBatch:
        """The plan as plain data, by difference from the batches before it. A decode row whose last token
        a step still running samples carries `PENDING_TOKEN` (overlap scheduling); every row's positions
        and sample count as in flight (`Sequence.inflight_tokens`) until the scheduler's `update`.
        `masks_later` (a step planned ahead): the constrained rows are those that may be masked once the
        step before it is applied, their masks sent later (`StepBatch.mask_later`)."""
        batch = StepBatch(num_decode=len(plan.decode), preempted=self._preempted)
        self._preempted = []
        for seq in plan.released:
            if self._sent.pop(seq.seq_id, None) is not None:
                batch.finished.append(seq.seq_id)
        # decode rows with drafts compute several tokens: they go after the one-token rows, as chunks; the
        # plan's decode list takes the batch's order (the engine core finds a row's sequence by it)
        plain = [seq for seq in plan.decode if seq.seq_id not in plan.drafts]
        batch.num_decode = len(plain)
        plan.decode = plain + [seq for seq in plan.decode if seq.seq_id in plan.drafts]
        scheduled = [
            (seq, seq.kv_next, [PENDING_TOKEN if seq.inflight_samples else seq.output_ids[-1]], True)
            for seq in plan.decode
        ]
        scheduled += [(c.seq, c.start, c.token_ids, c.completes_prompt) for c in plan.prefill]
        for row, (seq, start, token_ids, sample) in enumerate(scheduled):
            sent = self._sent.get(seq.seq_id)
            if sent is None:
                adapter = seq.adapter.ref if seq.adapter is not None else None
                batch.new.append(NewRequest(seq.seq_id, seq.prompt_ids, seq.params, seq.seed, adapter, seq.images))
                sent = 0
            assert seq.block_table is not None  # every scheduled sequence holds its blocks
            blocks = seq.block_table.blocks
            self._sent[seq.seq_id] = len(blocks)
            details = seq.params.decoder_input_details and row >= batch.num_decode
            drafts = plan.drafts.get(seq.seq_id, []) if row < len(plan.decode) else []
            propose = speculation.wanted(seq, row < len(plan.decode)) if speculation is not None and sample else 0
            batch.rows.append(
                ScheduledTokens(seq.seq_id, start, token_ids, blocks[sent:], sample, details, drafts, propose)
            )
            if sample and (seq.may_constrain_after(seq.inflight_samples) if masks_later else seq.grammar is not None):
                batch.grammar_rows.append(row)
            seq.inflight_tokens += 1 if row < len(plan.decode) else len(token_ids)
            seq.inflight_samples += sample
        batch.mask_later = masks_later and bool(batch.grammar_rows)
        return batch
