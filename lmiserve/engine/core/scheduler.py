"""What the scheduler (engine/core/block_scheduler.py) is made of: a pure state machine, no torch, no asyncio.

``schedule(now)`` decides what the next model step does (a :class:`StepPlan`, whose `batch` is the plain
data an executor runs); ``update(plan, output)`` applies the results and returns the events to deliver.

Prompts are prefilled in admission order (the waiting queue is ordered by ``priority``, lower first, then
arrival), in chunks bounded per step by ``max_prefill_tokens``; while sequences are decoding, a step takes
at most ``max(prefill_floor, decoding rows, max_running - decoding rows)`` prompt tokens (when
``prefill_floor`` is set): a step carries no more rows than a full batch or twice its decoding rows, so no
stream waits longer for a token than it would in a full batch or twice its current step, and a batch
that is still filling admits prompts quickly (benchmarks/README.md has the measurements). With a step
budget (``max_step_tokens``, vLLM's max_num_batched_tokens) each decode row costs one token of it and
prompt chunks take at most the rest.

Policies: *rolling* (continuous batching: sequences join at any step while fewer than ``max_running``
run) and *static* (dynamic batching: a batch forms from up to ``batch_size`` requests within
``max_batch_delay`` and runs to completion before the next one is admitted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lmiserve.engine.core.sequence import SeqStatus, Sequence
from lmiserve.engine.core.step import StepBatch


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


@dataclass
class StepPlan:
    """One step as the engine core sees it (sequences), with its plain-data `batch` for the executor."""

    released: list[Sequence] = field(default_factory=list)  # left the batch since the last step
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # in the batch's row order
    prefix_queried: int = 0  # prompt tokens of the sequences admitted for this step looked up in the cache
    prefix_hits: int = 0  # of which found there
    # the plan as plain data, what the executor runs (lmiserve.engine.core.step)
    batch: StepBatch = field(default_factory=StepBatch)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the drafts its decode row verifies

    @property
    def has_model_work(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def seqs(self) -> list[Sequence]:
        """The sequence of each of the batch's rows, in its order (the decode rows, then the chunks')."""
        return self.decode + [chunk.seq for chunk in self.prefill]


class SchedulerBase:
    """The scheduler's policy: the limits, the waiting queue in priority order, the running batch,
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
