"""The block scheduler: continuous batching over a block KV cache, one token budget a step, preemption.

A pure state machine (no torch, no asyncio), with the interface of `lmiserve.engine.core.scheduler.Scheduler`
(``add``, ``abort``, ``schedule(now)``, ``update(plan, output)``, ``expire``, ``next_wakeup``), over a
`lmiserve.engine.core.kv_blocks.BlockPool` that it owns.

Every sequence carries its tokens (prompt + generated) and how many of them have their KV computed
(``seq.kv_len``). A step computes, for each scheduled sequence, the next of its uncomputed tokens: one
for a decoding sequence (its last sampled token), a chunk of its prompt for a prefilling one; when a
sequence's computed tokens reach its end, the step samples its next token. Chunks of several prompts
share a step, so a long prompt no longer holds up a short one behind it: a step first gives every
decoding sequence its token, then fills its prompt budget (``max_prefill_tokens``; while sequences decode,
``max(prefill_floor, decoding rows, max_running - decoding rows)`` as the slot scheduler bounds it; with a
step budget, ``max_step_tokens`` (vLLM's max_num_batched_tokens), at most what the decode rows leave of
it, a row counting its token and its drafts; the stricter bound wins) with chunks of the running
prompts, then with newly admitted ones. While other prompts wait, a running
prompt's chunk takes at most half the budget, so a short prompt behind a long one starts at the next step.

Memory: a sequence's `BlockTable` grows by the blocks its scheduled tokens need, taken from the pool
all at once or not at all. Waiting sequences are admitted (in ``priority`` order, lower first, then
arrival) while the pool has the blocks for their first chunk; a request whose prompt plus
``max_new_tokens`` needs more blocks than the whole pool never fits and is refused at submission
(`never_fits`). When a running sequence needs a block and none is free, the scheduler preempts: the
running sequence of the highest ``priority`` value (then the latest arrival) gives its blocks back and
waits again at the head of its priority, its generated tokens kept; readmitted, it recomputes their KV
(vLLM v1's recompute) and goes on from where it was, so its stream neither skips nor changes a token.

The prefix cache is the pool itself: full blocks are registered under a hash chain of their tokens
once computed, and a newly admitted sequence starts from the cached blocks its tokens begin with
(`BlockPool.match_prefix`), shared, never copied. The ``n``/``best_of`` siblings of a request wait until
the first has computed its prompt, then start from its blocks.

Each plan also goes out as plain data (`StepPlan.batch`, a `lmiserve.engine.core.step.StepBatch`): what the
executor must learn of this step (new requests, tokens to compute, blocks gained, requests finished or
preempted), by difference from what it was told before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.engine.core.executor_view import ExecutorView
from lmiserve.engine.core.kv_blocks import BlockPool, BlockTable
from lmiserve.engine.core.scheduler import PrefillChunk, SchedulerBase, StepPlan
from lmiserve.engine.core.sequence import SeqStatus, Sequence
from lmiserve.engine.core.step import StepOutput
from lmiserve.engine.speculative.proposers import SpeculationPolicy
from lmiserve.engine.text.images import chunk_length


@dataclass(frozen=True)
class TokenChunk(PrefillChunk):
    """Tokens ``start .. start+length-1`` of a sequence (its prompt, or after a preemption also its
    generated tokens) to compute; the step samples when the chunk reaches the sequence's end."""

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == len(self.seq.prompt_ids) + len(self.seq.output_ids)


def _precedence(seq: Sequence) -> tuple[int, float, int]:
    """Lower runs first and is preempted last: priority, then arrival, then submission order."""
    return (seq.priority, seq.arrival, seq.seq_id)


class BlockScheduler(SchedulerBase):
    def __init__(self, pool: BlockPool, max_running: int = 32, max_prefill_tokens: int = 2048, **options: Any) -> None:
        """`options`: `SchedulerBase`'s."""
        super().__init__(max_running, max_prefill_tokens, **options)
        self.pool = pool
        self.prefix = None  # the slot scheduler's separate prefix cache: here the pool is the cache
        self.num_preemptions = 0
        self._budget = 0  # prompt tokens the step being planned may still take
        self.told = ExecutorView()  # what the executor was told: each plan goes out by difference from it
        # speculative decoding (engine/speculative/proposers.py): which rows ask for drafts after their step; the
        # drafts come back in `StepOutput.drafts` and are verified by the next step. `proposer` (tests)
        # drafts in the engine core instead. Neither: every decode row computes one token.
        self.speculation: SpeculationPolicy | None = None
        self.proposer: Callable[[Sequence], list[int]] | None = None
        self.masks_later = False  # overlap scheduling: the executor takes masks after a step's launch
        # LoRA (engine/lora/adapters.py): distinct adapters the running batch may hold (vLLM's max_loras); a waiting
        # request of another adapter waits, the requests behind it are admitted
        self.max_loras = 1 << 30

    # ---- intake ----------------------------------------------------------------------------------
    def never_fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens (prompt + max new tokens) needs more than the pool."""
        return self.pool.never_fits(num_tokens)

    def add(self, seq: Sequence) -> None:
        """Queue `seq` (priority order) with an empty block table."""
        super().add(seq)
        seq.block_table = BlockTable()

    def expire(self, now: float) -> list[Sequence]:
        """Remove and return waiting sequences that waited longer than queue_timeout (never one that
        was preempted: it has already streamed tokens)."""
        if self.queue_timeout is None:
            return []
        timeout = self.queue_timeout
        expired = [s for s in self.waiting if not s.output_ids and now - s.arrival > timeout]
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
        return expired

    # ---- planning --------------------------------------------------------------------------------
    def can_plan_ahead(self) -> bool:
        """Whether the next step may be planned while the step before it runs (`schedule(ahead=True)`):
        not with speculative decoding (a step's drafts come from the step before it), nor while a sequence's
        next token may be masked (its mask follows the token before it) unless the executor takes the masks
        after the step (`masks_later`)."""
        if self.speculation is not None or self.proposer is not None:
            return False
        return self.masks_later or not any(s.may_constrain for s in [*self.running, *self.waiting])

    def schedule(self, now: float, ahead: bool = False) -> tuple[StepPlan, list[tuple[Sequence, StepEvent]]]:
        """Plan the next step. Also returns events for sequences ended without a step (abort).

        `ahead`: the step before it is still running (overlap scheduling, `can_plan_ahead`): a sequence
        that step samples decodes the token it will sample (`PENDING_TOKEN`, which the executor reads from
        its own persistent batch), unless that token is its last by length; nothing is preempted (a
        sequence that finds no free block waits for a later step, planned when nothing runs). A sequence
        that turns out to end with that token (a stop) has one step computed in vain, whose token
        `update` drops."""
        events: list[tuple[Sequence, StepEvent]] = []
        for seq in [s for s in self.running if s.abort_requested]:
            events.append((seq, seq.end(FinishReason.ABORT)))
            self._remove(seq)
        for seq in [s for s in self.waiting if s.abort_requested]:
            self.waiting.remove(seq)
            self._free(seq)
            self._released.append(seq)  # a preempted one: the executor forgets it
            events.append((seq, seq.end(FinishReason.ABORT)))
        plan = StepPlan(released=self._released)
        self._released = []
        self._schedule_running(plan, ahead)
        self._admit(plan, now)
        plan.prefix_queried, plan.prefix_hits = self._queried, self._hits
        self._queried = self._hits = 0
        plan.batch = self.told.batch(plan, self.speculation, ahead and self.masks_later)
        return plan, events

    def _schedule_running(self, plan: StepPlan, ahead: bool = False) -> None:
        """Every decoding sequence its next token, then chunks of the running prompts; a sequence that
        needs a block when none is free preempts the running sequence of least precedence."""
        queue = sorted(self.running, key=_precedence)
        decode_rows = [s for s in queue if s.decoding]
        decoding = len(decode_rows)
        prefilling = len(queue) - decoding
        budget = 0
        # the step's budget beyond one token a decode row: what drafts may take (None: no step budget)
        spare = None if self.max_step_tokens is None else self.max_step_tokens - decoding
        decode_tokens = 0  # tokens of the decode rows scheduled, drafts included
        if self.speculation is not None:
            self.speculation.plan(decoding)
        scheduled: set[int] = set()
        # `self.running` by id: a list's `in` would scan it for every row (quadratic in the batch); only a
        # preemption below takes a sequence out of it
        running = {s.seq_id for s in queue}
        for phase in (SeqStatus.RUNNING, SeqStatus.PREFILL):
            rows = decode_rows
            if phase is SeqStatus.PREFILL:  # the prompt side: what the decode rows leave of the step
                budget = self._prefill_budget(decoding, decode_tokens)
                rows = [s for s in queue if s.status is SeqStatus.PREFILL and not s.decoding]
            for seq in rows:
                if seq.seq_id not in running:
                    continue  # preempted in this plan
                drafts: list[int] = []
                table = self._table(seq)
                if phase is SeqStatus.RUNNING:
                    if len(seq.output_ids) + seq.inflight_samples >= seq.params.max_new_tokens:
                        continue  # the step in flight samples its last token
                    if seq.drafts or self.proposer is not None:
                        drafts = self._drafts(seq)
                    if spare is not None:  # drafts count in the step's budget too (vLLM's counting)
                        drafts = drafts[: max(spare, 0)]
                    # the drafts' blocks only when free: never a preemption for them
                    if drafts and not self.pool.allocate(table, 1 + len(drafts)):
                        drafts = []
                    if spare is not None:
                        spare -= len(drafts)
                    want = 0 if drafts else 1
                else:
                    remaining = self._uncomputed(seq)
                    if budget <= 0 and (plan.prefill or plan.decode):
                        break
                    # while other prompts wait, one prompt's chunk takes at most half the budget
                    share = budget // 2 if self.waiting or prefilling > 1 else budget
                    want = min(remaining, max(share, 1)) if self.chunked_prefill else remaining
                    want = chunk_length(seq.images, seq.kv_next, want)  # an image never split where it must not be
                while not self.pool.allocate(table, want):
                    if ahead:
                        break  # never a preemption while a step runs: it waits for a step planned after it
                    victim = next((s for s in reversed(queue) if s.seq_id not in scheduled), None)
                    if victim is None:
                        break
                    queue.remove(victim)
                    self._preempt(victim)
                    running.discard(victim.seq_id)
                    if victim is seq:
                        break
                if seq.seq_id not in running:
                    continue
                if table.num_tokens < seq.kv_next + max(want, 1):
                    continue  # nothing left to preempt: it waits for a later step
                scheduled.add(seq.seq_id)
                if phase is SeqStatus.RUNNING:
                    plan.decode.append(seq)
                    decode_tokens += 1 + len(drafts)
                    if drafts:
                        plan.drafts[seq.seq_id] = drafts
                else:
                    plan.prefill.append(TokenChunk(seq, seq.kv_next, want))
                    budget -= want
        self._budget = budget

    def _drafts(self, seq: Sequence) -> list[int]:
        """The drafts `seq`'s next step verifies (those proposed after its last step, or the engine-core
        `proposer`'s), at most as many as its remaining tokens allow (the step gives it up to one more
        than its drafts) and its thinking budget allows (`Sequence.draft_limit`); none with a grammar (its
        matcher would have to mask every draft position)."""
        proposed, seq.drafts = seq.drafts, []
        if not proposed and self.proposer is None:
            return []  # nothing proposed (no speculative decoding: every step)
        if seq.grammar is not None:
            return []
        if self.proposer is not None:
            proposed = list(self.proposer(seq))
        room = seq.params.max_new_tokens - len(seq.output_ids) - 1
        limit = seq.draft_limit
        if limit is not None:
            room = min(room, limit)
        return proposed[:room] if room > 0 else []

    def _admit(self, plan: StepPlan, now: float) -> None:
        """Admit waiting sequences (priority order) while a slot, the budget and the blocks for their
        first chunk are there."""
        limit = self._admission_limit(now)
        budget = self._budget
        adapters = {s.adapter.id for s in self.running if s.adapter is not None}
        for seq in list(self.waiting):
            if len(self.running) >= limit:
                break
            if budget <= 0 and (plan.prefill or plan.decode):
                break
            if self._waits_for_sibling(seq):
                continue
            if seq.adapter is not None and seq.adapter.id not in adapters and len(adapters) >= self.max_loras:
                continue  # max_loras adapters run already: it waits for one of them to leave the batch
            tokens = seq.prompt_ids + seq.output_ids
            table = self._table(seq)
            salt = seq.cache_salt
            if seq.params.decoder_input_details and not seq.output_ids:
                match_blocks: tuple[int, ...] = ()  # prompt logprobs need the logits of every position
                cached = 0
            else:
                spans = seq.images.spans if seq.images is not None else None
                match = self.pool.match_prefix(tokens, salt, max_tokens=len(tokens) - 1, images=spans)
                match_blocks, cached = match.blocks, match.num_cached_tokens
            remaining = len(tokens) - cached
            want = chunk_length(seq.images, cached, min(remaining, budget) if self.chunked_prefill else remaining)
            if not self.pool.allocate(table, want, match_blocks):
                break  # the pool is full: admissions wait (running sequences are never preempted for them)
            if not seq.preemptions and not seq.params.decoder_input_details:
                # a request's prompt is looked up once, when admitted (vLLM's counting)
                self._queried += len(tokens)
                self._hits += cached
            self.waiting.remove(seq)
            seq.status = SeqStatus.PREFILL
            if seq.scheduled_at is None:
                seq.scheduled_at = now
            seq.kv_len = cached
            if not seq.output_ids:
                seq.cached_tokens = cached
            self.running.append(seq)
            if seq.adapter is not None:
                adapters.add(seq.adapter.id)
            plan.prefill.append(TokenChunk(seq, cached, want))
            budget -= want

    def _waits_for_sibling(self, seq: Sequence) -> bool:
        """`n`/`best_of` siblings start from the first one's computed prompt (shared blocks)."""
        if seq.index == 0 or not self.pool.enable_prefix_caching or seq.output_ids:
            return False
        first = next((s for s in self.running if s.request_id == seq.request_id and s.index == 0), None)
        return first is not None and first.kv_len < first.prompt_len

    @staticmethod
    def _uncomputed(seq: Sequence) -> int:
        return len(seq.prompt_ids) + len(seq.output_ids) - seq.kv_next

    @staticmethod
    def _table(seq: Sequence) -> BlockTable:
        table = seq.block_table
        if table is None:
            table = seq.block_table = BlockTable()
        return table

    def _preempt(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back; it waits again at the head of its priority, its tokens kept."""
        self.running.remove(seq)
        self._free(seq)
        seq.kv_len = seq.inflight_tokens = seq.inflight_samples = 0  # (nothing of it runs: never ahead)
        seq.drafts = []
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.told.preempted(seq)
        at = 0
        while at < len(self.waiting) and self.waiting[at].priority < seq.priority:
            at += 1
        self.waiting.insert(at, seq)

    def _free(self, seq: Sequence) -> None:
        if seq.block_table is not None:
            self.pool.free(seq.block_table)

    # ---- results ---------------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Sequence, StepEvent]]:
        """Apply a step's results (a step planned ahead of it may be running meanwhile): the sequences'
        computed positions, their sampled tokens (the events), the finished ones out of the batch."""
        events: list[tuple[Sequence, StepEvent]] = []
        sampling: list[Sequence] = []
        for seq in plan.decode:
            seq.inflight_tokens -= 1
            seq.inflight_samples -= 1
        for chunk in plan.prefill:
            chunk.seq.inflight_tokens -= chunk.length
            chunk.seq.inflight_samples -= chunk.completes_prompt
        running = {s.seq_id for s in self.running}
        for chunk in plan.prefill:
            seq = chunk.seq
            if seq.seq_id in output.errors or seq.seq_id not in running:
                continue
            seq.kv_len = chunk.start + chunk.length
            scores = output.prompt_logprobs.get(seq.seq_id)
            if scores is not None and scores[0] == len(seq.prefill_tokens):  # not again after a preemption
                seq.add_prompt_logprobs(*scores)
            self._cache(seq)
            if chunk.completes_prompt:
                seq.status = SeqStatus.RUNNING
                sampling.append(seq)
        drafted: list[Sequence] = []
        for seq in plan.decode:
            if seq.seq_id in output.errors or seq.seq_id not in running:
                continue
            if seq.seq_id in plan.drafts:
                drafted.append(seq)  # its KV is known once its drafts are verified
            else:
                seq.kv_len += 1
                self._cache(seq)
            sampling.append(seq)
        for seq in sampling:
            seq.drafts = output.drafts.get(seq.seq_id, [])
            for sample in output.samples.get(seq.seq_id, ()) if not seq.finished else ():
                event = seq.on_token(sample.token_id, sample.logprob, sample.top)
                events.append((seq, event))
                if seq.finished:
                    self._remove(seq)
                    break
        for seq in drafted:
            samples = output.samples.get(seq.seq_id)
            if self.speculation is not None and samples:
                self.speculation.record(seq, len(plan.drafts[seq.seq_id]), len(samples) - 1)
            if seq in self.running:
                # computed: its last token and the accepted drafts (all the samples but the last); the
                # rejected drafts' positions are written again by the steps to come
                seq.kv_len += len(samples or ())
                self._table(seq).num_tokens = seq.kv_len
                self._cache(seq)
        for seq_id, message in output.errors.items():
            failed = next((s for s in self.running if s.seq_id == seq_id), None)
            if failed is not None:
                events.append((failed, failed.end(FinishReason.ERROR, message)))
                self._remove(failed)
        return events

    def _cache(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks for sharing (most decode steps fill none:
        then the token list is not built)."""
        table = seq.block_table
        if not self.pool.enable_prefix_caching or table is None:
            return
        if seq.kv_len // self.pool.block_size > len(table.block_hashes):
            tokens = (seq.prompt_ids + seq.output_ids)[: seq.kv_len]
            self.pool.cache_full_blocks(table, tokens, seq.cache_salt, seq.images.spans if seq.images else None)

    def _remove(self, seq: Sequence) -> None:
        """Take `seq` out of the batch and give its blocks back (cached full blocks stay findable)."""
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        self._released.append(seq)
