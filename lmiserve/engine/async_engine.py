"""The asyncio engine: one background task drives the scheduler; model steps run in a worker thread.

Requests are validated and tokenized in `submit`, wait FIFO (up to `job_queue_size`), join the running
batch at the next step, and receive their events through a per-request queue. A client that stops
iterating (disconnect -> CancelledError/GeneratorExit) aborts its sequences, which leave the batch at
the next step. One request's failure reaches that request only; the loop survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lmiserve.core.aio import cancel_and_wait
from lmiserve.core.errors import Overloaded, QueueTimeout, ShuttingDown
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest
from lmiserve.engine import torch_thread
from lmiserve.engine.scheduler import Scheduler, StepOutput
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.validation import PromptCodec

if TYPE_CHECKING:
    from lmiserve.engine.runners.base import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_running: int = 32
    max_prefill_tokens: int = 2048
    job_queue_size: int = 1000
    predict_timeout: float | None = 120.0
    static_batching: bool = False
    batch_size: int = 1
    max_batch_delay: float = 0.1
    batch_invariant: bool = False
    fast_path: bool = True  # own Llama-family forward when supported; False forces the generic path
    # prompt tokens a step that also decodes may take: max(this, decoding rows, max_running - decoding rows);
    # None = no extra bound; "auto" = by device (engine/factory.py)
    prefill_floor: int | Literal["auto"] | None = "auto"


class _Handle:
    """One submitted request: its sequences and the queue their events (or its error) arrive on."""

    def __init__(self, request: GenerationRequest, seqs: list[Sequence]) -> None:
        self.request = request
        self.seqs = seqs
        self.queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        self.open = len(seqs)


class AsyncEngine:
    """The continuous-batching `TextGenerator` (lmiserve.core.engine) of one loaded LLM."""

    def __init__(self, runner: ModelRunner, codec: PromptCodec, config: EngineConfig) -> None:
        floor = config.prefill_floor
        if floor == "auto":
            raise ValueError("prefill_floor 'auto' is resolved by the device (engine.factory.create_engine)")
        self.runner = runner
        self.codec = codec
        self.config = config
        self.scheduler = Scheduler(
            config.max_running,
            config.max_prefill_tokens,
            chunked_prefill=not config.batch_invariant,
            static_batching=config.static_batching,
            batch_size=config.batch_size,
            max_batch_delay=config.max_batch_delay,
            queue_timeout=config.predict_timeout,
            prefill_floor=floor,
        )
        self._handles: dict[int, _Handle] = {}  # seq_id -> handle
        self._ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="lmiserve-engine")

    async def stop(self) -> None:
        """Stop the loop; requests still open end with an error instead of waiting forever."""
        await cancel_and_wait(self._task)
        self._task = None
        for seq_id in list(self._handles):
            self._fail_before_start(seq_id, ShuttingDown())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> _Handle:
        """Validate, tokenize and enqueue; raises InvalidRequest or Overloaded at once."""
        prompt_ids = self.codec.encode(request)
        count = max(request.params.n, request.params.best_of)
        if len(self.scheduler.waiting) + count > self.config.job_queue_size:
            raise Overloaded("Worker queue capacity exceeded")
        base_seed = request.params.seed if request.params.seed is not None else _random_seed()
        now = time.monotonic()
        seqs = [
            Sequence(
                next(self._ids),
                request.request_id,
                request.prompt,
                prompt_ids,
                request.params,
                tokenizer=self.codec.tokenizer,
                eos_token_ids=self.codec.eos_token_ids,
                special_token_ids=self.codec.special_token_ids,
                seed=base_seed + i,
                index=i,
                arrival=now,
            )
            for i in range(count)
        ]
        handle = _Handle(request, seqs)
        for seq in seqs:
            self._handles[seq.seq_id] = handle
            self.scheduler.add(seq)
        self._wakeup.set()
        return handle

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        """Events of one request. With n/best_of > 1 the sequences come whole, best first."""
        handle = self.submit(request)
        try:
            if len(handle.seqs) == 1:
                async for event in self._drain(handle):
                    yield event
            else:
                for event in await self._collect_ranked(handle):
                    yield event
        finally:
            self.abort(handle)

    def abort(self, handle: _Handle) -> None:
        for seq in handle.seqs:
            if not seq.finished:
                self.scheduler.abort(seq)
        self._wakeup.set()

    async def _drain(self, handle: _Handle) -> AsyncGenerator[StepEvent, None]:
        while handle.open:
            item = await handle.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish is not None:
                handle.open -= 1
            yield item

    async def _collect_ranked(self, handle: _Handle) -> list[StepEvent]:
        by_index: dict[int, list[StepEvent]] = {s.index: [] for s in handle.seqs}
        async for event in self._drain(handle):
            by_index[event.index].append(event)
        params = handle.request.params
        ranked = sorted(handle.seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        keep = params.n
        events: list[StepEvent] = []
        for new_index, seq in enumerate(ranked[:keep]):
            events.extend(_reindex(e, new_index) for e in by_index[seq.index])
        return events

    # ---- the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("engine step failed")
                await asyncio.sleep(0.01)

    async def _step(self) -> None:
        scheduler = self.scheduler
        self._wakeup.clear()
        now = time.monotonic()
        for seq in scheduler.expire(now):
            self._fail_before_start(seq.seq_id, QueueTimeout(f"Time out in: {self._timeout_text()}"))
        plan, events = scheduler.schedule(now)
        self._deliver(events)
        if not plan.has_model_work:
            if plan.moves or plan.released:
                await torch_thread.run(self.runner.execute, plan)  # frees per-sequence caches
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), scheduler.next_wakeup(time.monotonic()))
            return
        try:
            output: StepOutput = await torch_thread.run(self.runner.execute, plan)
        except Exception as exc:  # noqa: BLE001 - outside the per-sequence guards: end what was running
            log.exception("engine step failed")
            message = f"exception occurred during generation: {exc}"
            output = StepOutput(errors={s.seq_id: message for s in scheduler.running})
        self.steps += 1
        self._deliver(scheduler.update(plan, output))

    def _deliver(self, events: list[tuple[Sequence, StepEvent]]) -> None:
        for seq, event in events:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue
            if event.finish is not None:
                del self._handles[seq.seq_id]
                if event.finish.reason is FinishReason.ABORT:
                    continue
            handle.queue.put_nowait(event)

    def _fail_before_start(self, seq_id: int, error: BaseException) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            handle.queue.put_nowait(error)

    def _timeout_text(self) -> str:
        value = self.config.predict_timeout
        return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def _random_seed() -> int:
    """A random non-negative signed 32-bit seed, drawn per request when the client gives none."""
    return random.SystemRandom().randrange(0, 2**31)


def _reindex(event: StepEvent, index: int) -> StepEvent:
    return StepEvent(token=event.token, top_tokens=event.top_tokens, finish=event.finish, index=index)
