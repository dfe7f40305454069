"""The batch scheduler: a pure state machine, no torch, no asyncio.

``schedule(now)`` decides what the next model step does (a :class:`StepPlan`); the runner executes
it; ``update(plan, output)`` applies the results and returns the events to deliver.

Slots: running sequences occupy KV-cache slots ``0..R-1`` (decoding) followed by ``R..R+P-1``
(prefilling, in arrival order). When a sequence leaves, the plan lists the slot moves that keep
both ranges contiguous, so a decode step reads the cache through views. Prompts are prefilled in
admission order (the waiting queue is ordered by ``priority``, lower first, then arrival), in chunks
bounded per step by ``max_prefill_tokens``; while sequences are decoding, a
step takes at most ``max(prefill_floor, decoding rows, max_running - decoding rows)`` prompt tokens
(when ``prefill_floor`` is set): a step carries no more rows than a full batch or twice its decoding
rows, so no stream waits longer for a token than it would in a full batch or twice its current
step, and a batch that is still filling admits prompts quickly (benchmarks/README.md has the
measurements). With a step budget (``max_step_tokens``, vLLM's max_num_batched_tokens) each decode row
costs one token of it and prompt chunks take at most the rest.

Prefix cache (`prefix`, a `PrefixIndex`): a sequence admitted into the batch starts with the
cached blocks its prompt begins with (`StepPlan.loads`: the runner copies them into its slot; at least
one prompt token is left to prefill), and the blocks of a sequence's prompt (once prefilled) and of
its tokens (when it leaves, unless it failed) are stored (`StepPlan.saves`, copied out of the slot
before the step's slot moves that follow them).

Policies: *rolling* (continuous batching: sequences join at any step while fewer than
``max_running`` run) and *static* (dynamic batching: a batch forms from up to ``batch_size``
requests within ``max_batch_delay`` and runs to completion before the next one is admitted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.engine.prefix_cache import PrefixIndex, PrefixMatch
from lmiserve.engine.sequence import SeqStatus, Sequence
from lmiserve.engine.step import StepBatch, StepOutput


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.prompt_len

    @property
    def token_ids(self) -> list[int]:
        """The chunk's tokens (of the prompt; after a preemption, of the generated tokens too)."""
        seq = self.seq
        if self.start + self.length <= seq.prompt_len:
            return seq.prompt_ids[self.start : self.start + self.length]
        return (seq.prompt_ids + seq.output_ids)[self.start : self.start + self.length]


@dataclass(frozen=True)
class PrefixSave:
    """Copy blocks of a slot into the prefix cache's pool before slot move number `before_move`."""

    before_move: int
    slot: int
    blocks: list[tuple[int, int]]  # (block number in the sequence, pool block)


@dataclass(frozen=True)
class PrefixLoad:
    """Copy cached blocks into a newly admitted sequence's slot (after the saves and moves)."""

    seq: Sequence
    slot: int
    match: PrefixMatch


@dataclass
class StepPlan:
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src slot, dst slot, length)
    released: list[Sequence] = field(default_factory=list)  # left the batch since the last step
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # in slot order 0..len-1
    saves: list[PrefixSave] = field(default_factory=list)
    loads: list[PrefixLoad] = field(default_factory=list)
    prefix_queried: int = 0  # prompt tokens of the sequences admitted for this step looked up in the cache
    prefix_hits: int = 0  # of which found there
    # the block scheduler's plan as plain data, what its executor runs (lmiserve.engine.step)
    batch: StepBatch | None = None
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the drafts its decode row verifies

    @property
    def has_model_work(self) -> bool:
        return bool(self.prefill or self.decode)


class SchedulerBase:
    """What both schedulers share: the limits, the waiting queue in priority order, the running batch,
    aborts, the idle wake-up, the static-batching admission rule and a step's prompt budget."""

    def __init__(
        self,
        max_running: int = 32,
        max_prefill_tokens: int = 2048,
        *,
        chunked_prefill: bool = True,
        static_batching: bool = False,
        batch_size: int = 1,
        max_batch_delay: float = 0.1,
        queue_timeout: float | None = None,
        prefill_floor: int | None = None,
        max_step_tokens: int | None = None,
    ) -> None:
        self.max_running = max_running
        self.prefill_floor = prefill_floor
        self.max_prefill_tokens = max_prefill_tokens
        # the step's budget, decode rows included (vLLM's max_num_batched_tokens): None, none
        self.max_step_tokens = max_step_tokens
        self.chunked_prefill = chunked_prefill
        self.static_batching = static_batching
        self.batch_size = batch_size
        self.max_batch_delay = max_batch_delay
        self.queue_timeout = queue_timeout
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[Sequence] = []
        self._queried = self._hits = 0

    # ---- intake ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting sequence of a lower or equal priority (lower first; equal
        priorities in arrival order, so without priorities the queue is first come, first served)."""
        seq.status = SeqStatus.WAITING
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].priority > seq.priority:
            at -= 1
        self.waiting.insert(at, seq)

    def abort(self, seq: Sequence) -> None:
        """Ask for `seq` to leave; it does at the next `schedule` (within one step)."""
        seq.abort_requested = True

    @property
    def num_decoding(self) -> int:
        return sum(1 for s in self.running if s.status is SeqStatus.RUNNING)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    def next_wakeup(self, now: float) -> float | None:
        """Seconds until schedule() may have something new to do while idle (batch delay, timeouts)."""
        deadlines = []
        first = min((s.arrival for s in self.waiting), default=None)  # the queue is in priority order
        if first is not None and self.queue_timeout is not None:
            deadlines.append(first + self.queue_timeout)
        if self.static_batching and first is not None and not self.running:
            deadlines.append(first + self.max_batch_delay)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _admission_limit(self, now: float) -> int:
        """How many sequences may run after admissions now: rolling, `max_running`; static (dynamic
        batching), a batch once the running one is over and the queue is full or the delay passed, else
        no admission (0)."""
        if not self.static_batching:
            return self.max_running
        if self.running or not self.waiting:
            return 0
        full = len(self.waiting) >= self.batch_size
        if not full and now - min(s.arrival for s in self.waiting) < self.max_batch_delay:
            return 0
        return min(self.batch_size, self.max_running)

    def _prefill_budget(self, decoding: int, decode_tokens: int | None = None) -> int:
        """Prompt tokens a step may take: `max_prefill_tokens`; while `decoding` rows decode, at most
        max(prefill_floor, decoding rows, max_running - decoding rows); with a step budget
        (`max_step_tokens`), at most what the decode rows leave of it (`decode_tokens`, default one a
        row: vLLM's counting). The stricter bound wins."""
        budget = self.max_prefill_tokens
        if decoding and self.prefill_floor is not None:
            budget = min(budget, max(self.prefill_floor, decoding, self.max_running - decoding))
        if self.max_step_tokens is not None:
            budget = min(budget, self.max_step_tokens - (decoding if decode_tokens is None else decode_tokens))
        return budget


class Scheduler(SchedulerBase):
    def __init__(
        self,
        max_running: int = 32,
        max_prefill_tokens: int = 2048,
        *,
        prefix: PrefixIndex | None = None,
        **options: Any,
    ) -> None:
        """`options`: `SchedulerBase`'s; `prefix`: the prefix cache's index (None: off)."""
        super().__init__(max_running, max_prefill_tokens, **options)
        self._moves: list[tuple[int, int, int]] = []
        self.prefix = prefix
        self._saves: list[PrefixSave] = []
        self._loads: list[PrefixLoad] = []

    # ---- planning --------------------------------------------------------------------------------
    def schedule(self, now: float) -> tuple[StepPlan, list[tuple[Sequence, StepEvent]]]:
        """Plan the next step. Also returns events for sequences ended without a step (abort, timeout)."""
        events: list[tuple[Sequence, StepEvent]] = []
        for seq in [s for s in self.running if s.abort_requested]:
            events.append((seq, seq.end(FinishReason.ABORT)))
            self._remove(seq)
        for seq in [s for s in self.waiting if s.abort_requested]:
            self.waiting.remove(seq)
            events.append((seq, seq.end(FinishReason.ABORT)))
        self._admit(now)
        plan = StepPlan(moves=self._moves, released=self._released, saves=self._saves, loads=self._loads)
        plan.prefix_queried, plan.prefix_hits = self._queried, self._hits
        self._moves, self._released, self._saves, self._loads = [], [], [], []
        self._queried = self._hits = 0
        plan.decode = [s for s in self.running if s.status is SeqStatus.RUNNING]
        budget = self._prefill_budget(len(plan.decode))
        for seq in self.running:
            if seq.status is not SeqStatus.PREFILL or (budget <= 0 and (plan.prefill or plan.decode)):
                continue
            remaining = seq.prefill_remaining
            length = min(remaining, budget) if self.chunked_prefill else remaining
            if length <= 0:
                break
            plan.prefill.append(PrefillChunk(seq, seq.kv_len, length))
            budget -= length
            if length < remaining:
                break  # later prompts wait until this one is complete (slot order == prefill order)
        return plan, events

    def expire(self, now: float) -> list[Sequence]:
        """Remove and return waiting sequences that waited longer than queue_timeout."""
        if self.queue_timeout is None:
            return []
        expired = [s for s in self.waiting if now - s.arrival > self.queue_timeout]
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
        return expired

    def _admit(self, now: float) -> None:
        limit = self._admission_limit(now)
        while self.waiting and len(self.running) < limit:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.PREFILL
            seq.scheduled_at = now
            seq.slot = len(self.running)
            seq.kv_len = 0
            self.running.append(seq)
            self._lookup(seq)

    def _lookup(self, seq: Sequence) -> None:
        """Start a newly admitted sequence from the cached blocks its prompt begins with (not when it
        asks for prompt logprobs: those need the logits of every prompt position, nor with a `cache_salt`:
        this cache has no salts, so a salted request shares nothing)."""
        if self.prefix is None or seq.params.decoder_input_details or seq.cache_salt is not None:
            return
        found = self.prefix.match(seq.prompt_ids)
        self._queried += seq.prompt_len
        self._hits += found.tokens
        if found.tokens:
            assert seq.slot is not None
            seq.kv_len = seq.cached_tokens = found.tokens
            self._loads.append(PrefixLoad(seq, seq.slot, found))

    def _store(self, seq: Sequence, tokens: list[int]) -> None:
        """Keep the blocks of `tokens` (whose KV `seq`'s slot holds) that the cache lacks (never a salted
        request's: see `_lookup`)."""
        if self.prefix is None or seq.slot is None or seq.cache_salt is not None:
            return
        blocks = self.prefix.store(tokens)
        if blocks:
            self._saves.append(PrefixSave(len(self._moves), seq.slot, blocks))

    # ---- results ---------------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput) -> list[tuple[Sequence, StepEvent]]:
        events: list[tuple[Sequence, StepEvent]] = []
        if output.prefix_failed and self.prefix is not None:
            self.prefix.clear()
        for chunk in plan.prefill:
            seq = chunk.seq
            if seq.seq_id in output.errors:
                continue
            seq.kv_len = chunk.start + chunk.length
            if seq.seq_id in output.prompt_logprobs:
                seq.add_prompt_logprobs(*output.prompt_logprobs[seq.seq_id])
            if chunk.completes_prompt:
                seq.status = SeqStatus.RUNNING
                self._store(seq, seq.prompt_ids)
        for seq in plan.decode:
            if seq.seq_id not in output.errors:
                seq.kv_len += 1
        for seq in [c.seq for c in plan.prefill if c.completes_prompt] + plan.decode:
            if seq.finished:
                continue
            if seq.seq_id in output.errors:
                continue
            for sample in output.samples.get(seq.seq_id, ()):
                event = seq.on_token(sample.token_id, sample.logprob, sample.top)
                events.append((seq, event))
                if seq.finished:
                    self._remove(seq)
                    break
        for seq_id, message in output.errors.items():
            failed = next((s for s in self.running if s.seq_id == seq_id), None)
            if failed is not None:
                events.append((failed, failed.end(FinishReason.ERROR, message)))
                self._remove(failed, keep=False)
        return events

    def _remove(self, seq: Sequence, *, keep: bool = True) -> None:
        """Take `seq` out of the batch, moving others so decoding and prefilling slots stay contiguous.
        With `keep`, the blocks of its tokens whose KV it computed are stored in the prefix cache first."""
        if keep:
            self._store(seq, seq.all_ids[: seq.kv_len])
        slot = self.running.index(seq)
        self.running.pop(slot)
        seq.status = SeqStatus.FINISHED
        self._released.append(seq)
        decoding = self.num_decoding
        if slot < decoding:
            # A decoding sequence left: the last decoding one takes its slot; the prefilling ones shift down.
            last = self.running.pop(decoding - 1)
            self.running.insert(slot, last)
        for new_slot in range(slot, len(self.running)):
            moved = self.running[new_slot]
            assert moved.slot is not None  # every running sequence holds a slot
            if moved.slot != new_slot:
                self._moves.append((moved.slot, new_slot, moved.kv_len))
                moved.slot = new_slot
        seq.slot = None
