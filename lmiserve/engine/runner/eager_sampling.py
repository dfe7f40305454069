"""The eager sampler's side of a persistent batch (runner/persistent_batch.py): the rows sampled on the host's
orders from the step's logits (runner/sampling.py's `sample_rows`), those with a grammar from copies masked by
the batch's bitmask, and a row's drafts verified position by position. A row a decode graph's pick serves
never comes here (`PersistentBatchRunner._graph_served`)."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from lmiserve.engine.core.step import ScheduledTokens, StepBatch, StepOutput
from lmiserve.engine.runner.in_flight import StepsInFlight
from lmiserve.engine.runner.penalties import BookedRow, PenaltyBook
from lmiserve.engine.runner.request_state import RequestState
from lmiserve.engine.runner.sampling import Row, sample_rows, sampler_row
from lmiserve.engine.text.token_mask import apply_bitmask

__all__ = ["EagerSampling"]

log = logging.getLogger(__name__)


class EagerSampling:
    """A persistent batch runner's rows sampled from their logits (a mixin: the runner's requests, steps in
    flight, EOS ids and vocabulary)."""

    _requests: dict[int, RequestState]
    in_flight: StepsInFlight
    eos_token_ids: list[int]
    vocab_size: int
    penalties: PenaltyBook  # the penalized requests' tokens (runner/penalties.py)
    # a `mask_later` batch's rows that may be masked, until their masks come (`sample_masked`): the batch,
    # the rows (indexes into it) and their logits (copies)
    _held: list[tuple[StepBatch, list[int], torch.Tensor]]

    defers_masks = True  # (`Executor.defers_masks`)

    def _sample_eager(self, batch: StepBatch, sampling: list[int], rows: torch.Tensor, out: StepOutput) -> None:
        """The eager sampler's rows: `sampling` (indexes into batch.rows) from `rows` (theirs, in order), the
        constrained ones masked by the batch's grammar bitmask, after every step in flight; those of a
        `mask_later` batch that may be masked are held until their masks come."""
        if batch.mask_later:
            sampling, rows = self._hold(batch, sampling, rows)
            if not sampling:
                return
        try:
            masked = self._masked(batch, sampling, rows)
        except Exception as exc:  # noqa: BLE001 - the constrained rows fail, the others are sampled
            log.exception("masking the constrained rows failed")
            constrained = set(batch.grammar_rows)
            for i in sampling:
                if i in constrained:
                    out.errors[batch.rows[i].seq_id] = f"exception occurred during sampling: {exc}"
            masked = {}
        picked: list[int] = []  # positions in `sampling` that are sampled
        specs: list[Row] = []
        for n, i in enumerate(sampling):
            seq_id = batch.rows[i].seq_id
            if seq_id in out.errors:
                continue
            try:
                specs.append(self._row_of(self._requests[seq_id], rows.device, masked.get(n)))
                picked.append(n)
            except Exception as exc:  # noqa: BLE001 - one request fails, the step goes on
                out.errors[seq_id] = f"exception occurred during sampling: {exc}"
        if not picked:
            return
        self.in_flight.receive()  # this step's tokens follow theirs
        try:
            results = sample_rows(rows if len(picked) == len(rows) else rows[picked], specs)
        except Exception as exc:  # noqa: BLE001 - the step's sampling rows fail, the engine goes on
            log.exception("sampling failed for %d sequence(s)", len(picked))
            results = [exc] * len(picked)
        for n, result in zip(picked, results):
            seq_id = batch.rows[sampling[n]].seq_id
            if isinstance(result, Exception):
                out.errors[seq_id] = f"exception occurred during sampling: {result}"
            else:
                self._requests[seq_id].output_ids.append(result.token_id)
                out.samples[seq_id] = [result]

    def _hold(self, batch: StepBatch, sampling: list[int], rows: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Hold the rows of `sampling` that may be masked (their logits copied: a decode graph's are written
        again by its next replay); the others and their logits, to sample now."""
        later = set(batch.grammar_rows)
        held = [n for n, i in enumerate(sampling) if i in later]
        if not held:
            return sampling, rows
        self._held.append((batch, [sampling[n] for n in held], rows[held]))
        kept = [n for n, i in enumerate(sampling) if i not in later]
        return [sampling[n] for n in kept], rows[kept]

    def sample_masked(self, rows: list[int], bitmask: np.ndarray | None) -> StepOutput:
        """`Executor.sample_masked`: the held rows sampled, those in `rows` masked by `bitmask`'s rows."""
        held, self._held = self._held, []
        out = StepOutput()
        with torch.inference_mode():
            for batch, sampling, logits in held:
                masks = replace(batch, grammar_rows=rows, grammar_bitmask=bitmask, mask_later=False)
                self._sample_eager(masks, sampling, logits, out)
        return out

    def _verify(self, row: ScheduledTokens, logits: torch.Tensor, out: StepOutput) -> None:
        """A row's drafts verified against its `logits` (one row a position: its last token's, then each
        draft's): each position sampled in turn as the request samples (its parameters, penalties over
        the tokens before it, its generator), a draft kept while it equals its position's sample. For a
        greedy request the tokens are those of one token a step; a sampled one draws once a token, each
        from the target's distribution (rejection sampling with a draft that puts all its mass on one
        token), so a seeded stream is the same with or without drafts."""
        request = self._requests[row.seq_id]
        drafts = row.draft_token_ids
        results = []
        try:
            for position in range(len(drafts) + 1):
                spec = self._row_of(request, logits.device, None)
                result = sample_rows(logits[position : position + 1], [spec])[0]
                if isinstance(result, Exception):
                    raise result
                request.output_ids.append(result.token_id)
                results.append(result)
                if position == len(drafts) or result.token_id != drafts[position]:
                    break
        except Exception as exc:  # noqa: BLE001 - one request fails, the step goes on
            log.exception("verifying drafts failed")
            out.errors[row.seq_id] = f"exception occurred during sampling: {exc}"
            return
        out.samples[row.seq_id] = results

    def _row_of(self, request: RequestState, device: torch.device, masked: torch.Tensor | None) -> Row:
        """What the sampler needs of a request (its generator made on its first sampled token; a penalized
        one's slot in the book opened on its first row)."""
        row = sampler_row(
            request.params,
            request.prompt_ids,
            request.output_ids,
            self.eos_token_ids,
            request.seed,
            request.generator,
            device,
        )
        request.generator, row.masked = row.generator, masked
        if request.penalized:
            row.penalty = BookedRow(self.penalties, self._penalty_slot(request))
        return row

    def _penalty_slot(self, request: RequestState) -> int:
        """A penalized request's slot in the book, opened on its first sampled row (eager or in a graph)."""
        if request.penalty_slot is None:
            request.penalty_slot = self.penalties.open(request.prompt_ids, request.output_ids)
        return request.penalty_slot

    def _forget(self, request: RequestState | None) -> None:
        """A request the persistent batch no longer holds (finished, or replaced): its book slot freed."""
        if request is not None and request.penalty_slot is not None:
            self.penalties.close(request.penalty_slot)
            request.penalty_slot = None

    def _masked(self, batch: StepBatch, sampling: list[int], rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """Masked copies of the constrained sampling rows (by position in `sampling`)."""
        if batch.grammar_bitmask is None or not batch.grammar_rows:
            return {}
        where = {row: n for n, row in enumerate(batch.grammar_rows)}
        picked = [(n, where[i]) for n, i in enumerate(sampling) if i in where]
        if not picked:
            return {}
        copies = rows[[n for n, _ in picked]]  # advanced indexing: a copy; the raw rows stay for the logprobs
        apply_bitmask(copies, batch.grammar_bitmask[[m for _, m in picked]], self.vocab_size)
        return {n: copies[k] for k, (n, _) in enumerate(picked)}
