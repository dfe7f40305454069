"""The engine core: the scheduler over the KV block pool, the executor that runs each step's plain-data
batch, and the asyncio loop between them. One background task plans a step, runs it (and the scheduler's
update of its results) on the model's torch thread and delivers the events to each request's queue; one
request's failure reaches that request only, and a failure of the core itself ends every request and
tells the `on_failure` listeners. `AsyncEngine` (core/async_engine.py) takes the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lmiserve.core.aio import cancel_and_wait
from lmiserve.core.errors import GenerationFailed, QueueTimeout, ShuttingDown
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.stats import EngineObserver, StepStats, notify, tell_failure
from lmiserve.engine import torch_thread
from lmiserve.engine.core.block_scheduler import BlockScheduler
from lmiserve.engine.core.config import EngineConfig
from lmiserve.engine.core.handles import RequestHandle, prompt_tokens_computed, request_stats, stamp_events
from lmiserve.engine.core.kv_blocks import BlockPool
from lmiserve.engine.core.kv_fits import check_fits
from lmiserve.engine.core.scheduler import StepPlan
from lmiserve.engine.core.sequence import Sequence
from lmiserve.engine.core.step import BatchRunner, Executor, ExecutorFailed, Launched, StepOutput
from lmiserve.engine.core.step_masks import StepMasks, add_held, fail_rows
from lmiserve.engine.executors.in_process import InProcessExecutor
from lmiserve.engine.lora.registry import AdapterRegistry
from lmiserve.engine.speculative.proposers import SpeculationPolicy

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A step handed to the torch thread whose results are not applied yet (overlap scheduling)."""

    plan: StepPlan
    launched: asyncio.Future[Launched]
    submitted: float
    # a `mask_later` step's held rows sampled once the step before it is applied (their samples and errors)
    masked: asyncio.Future[StepOutput] | None = None


def _nothing() -> None:
    """Run on the torch thread after the work queued there (`EngineCore.stop` waits for it)."""


class EngineCore:
    """The scheduler, the executor and the loop of one loaded LLM (requests: `AsyncEngine`)."""

    def __init__(
        self, runner: BatchRunner | Executor, config: EngineConfig, adapters: AdapterRegistry | None = None
    ) -> None:
        """`runner`: the model's runner (run in this process), or an executor that runs the plain-data
        batches elsewhere (the tensor-parallel workers, engine/executors/tensor_parallel.py); `adapters`: the LoRA
        adapters requests may name (their loads let go are told to the executor each step)."""
        floor = config.prefill_floor
        if floor == "auto":
            raise ValueError("prefill_floor 'auto' is resolved by the device (engine.factory.create_engine)")
        # this model's torch thread: the shared one on the CPU, its own on a GPU (engine/torch_thread.py)
        self.thread = torch_thread.for_device(getattr(runner, "device", "cpu"), f"engine-{id(self):x}")
        self.config = config
        options: dict[str, Any] = {
            "chunked_prefill": not config.batch_invariant,
            "static_batching": config.static_batching,
            "batch_size": config.batch_size,
            "max_batch_delay": config.max_batch_delay,
            "queue_timeout": config.predict_timeout,
            "prefill_floor": floor,
            "max_step_tokens": config.max_step_tokens,
        }
        self.executor = runner if isinstance(runner, Executor) else InProcessExecutor(runner)
        self._masks = StepMasks(self.executor)  # the executor's batches' grammar bitmask
        # blocks computed in another step's shapes round differently: no sharing when batch-invariant
        caching = config.enable_prefix_caching and not config.batch_invariant
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=caching)
        self.scheduler = BlockScheduler(self.pool, config.max_running, config.max_prefill_tokens, **options)
        self.scheduler.masks_later = self.executor.defers_masks
        self.speculation: SpeculationPolicy | None = None
        if config.speculation is not None:
            self.speculation = self.scheduler.speculation = SpeculationPolicy(config.speculation)
        self.adapters = adapters
        if adapters is not None:
            self.scheduler.max_loras = adapters.limits.max_loras
        self._handles: dict[int, RequestHandle] = {}  # seq_id -> handle
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._observers: list[EngineObserver] = []
        self.steps = 0
        self.generated_tokens = 0  # since start, for `snapshot`
        self.failure: str | None = None  # why the engine core failed (`_die`); it serves nothing then
        self.on_failure: list[Callable[[str], None]] = []
        # overlap scheduling: the next step is planned and queued while this one runs (`_step`)
        self.async_scheduling = bool(config.async_scheduling)
        self._ahead: _InFlight | None = None  # the step planned ahead, queued behind the running one
        self._current: _InFlight | None = None  # the step whose results the loop waits for
        self._last_done = 0.0  # when the last step's results came back (a queued step's start)
        self.steps_ahead = 0  # model steps planned while the step before them ran

    @property
    def runner(self) -> BatchRunner | None:
        """The model's runner when it runs in this process (None: the executor runs it elsewhere)."""
        return self.executor.runner if isinstance(self.executor, InProcessExecutor) else None

    def _check_fits(self, tokens: int) -> None:
        """A request whose KV (prompt + max new tokens) needs more blocks than the whole pool is refused."""
        check_fits(tokens, self.pool.num_blocks, self.pool.block_size)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._loop(), name="lmiserve-engine")

            def failed(why: str) -> None:
                loop.call_soon_threadsafe(self._executor_failed, why)

            self.executor.watch(failed)

    def _executor_failed(self, why: str) -> None:
        """The executor failed between steps (a worker process died): the engine fails now, not at its
        next request."""
        self._die(ExecutorFailed(why))
        self._wakeup.set()

    async def stop(self) -> None:
        """Stop the loop; requests still open end with an error instead of waiting forever."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._current is not None or self._ahead is not None:
            # the steps handed to the torch thread end (or, not started, never run) before the executor closes
            await self.thread.run(_nothing)
        self._current = self._ahead = None
        await asyncio.to_thread(self.executor.close)
        self.thread.close()
        for seq_id in list(self._handles):
            self._fail_before_start(seq_id, ShuttingDown())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- observers (lmiserve.core.stats) -------------------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """The observers see nothing of what runs meanwhile (the engine's own warm-up, engine/core/warmup.py)."""
        observers, self._observers = self._observers, []
        try:
            yield
        finally:
            self._observers = observers + self._observers

    def _notify(self, method: str, *args: object) -> None:
        notify(self._observers, method, *args)

    def _release(self, handle: RequestHandle) -> None:
        """What a request held until it ended is given back (`AsyncEngine`: its LoRA adapter)."""

    # ---- the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine core itself failed: its state is in doubt
                log.exception("engine failed")
                self._die(exc)
                return

    def _die(self, exc: Exception) -> None:
        """The engine core failed outside the per-request guards (planning, applying a step's results):
        every open request ends with an error (in-band on a stream that started), new ones are refused,
        and the `on_failure` listeners are told (the service turns unhealthy; `lmiserve serve` exits
        non-zero so that the orchestrator starts it again). A model step's failure is not this: it fails
        the requests of the step and the engine goes on. Only the first failure counts."""
        if self.failure is not None:
            return
        self.failure = f"the engine failed: {type(exc).__name__}: {exc}"
        error = GenerationFailed(self.failure)  # each protocol's shape says the rest (TGI: "Request failed ...")
        for seq_id in list(self._handles):
            self._fail_before_start(seq_id, error)
        tell_failure(self.on_failure, self.failure)

    def _execute(self, plan: StepPlan) -> tuple[StepOutput, list[tuple[Sequence, StepEvent]]]:
        """Run `plan` and apply its results (on the torch thread): the model step, then the scheduler's
        update, whose per-token work (detokenizing, stop strings, grammar matchers, building the events)
        so stays off the HTTP event loop; the loop only delivers the events. Meanwhile the loop may only
        add to the waiting queue and flag aborts, which `update` does not touch."""
        output = self._run_guarded(plan, every_running=True)
        return output, self.scheduler.update(plan, output)

    def _run_guarded(self, plan: StepPlan, every_running: bool = False) -> StepOutput:
        """The model work of `plan`, where a failure outside the per-request guards fails requests, not the
        engine: the step's (overlap scheduling), or with `every_running` every running one (the serial loop,
        on the torch thread). An `ExecutorFailed` fails the engine (`_loop`)."""
        return self._collect_guarded(plan, self._launch_guarded(plan, every_running), every_running)

    def _launch_guarded(self, plan: StepPlan, every_running: bool = False) -> Launched:
        try:
            return self._launch(plan)
        except ExecutorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - outside the per-sequence guards
            return Launched(self._step_failed(plan, exc, every_running))

    def _collect_guarded(self, plan: StepPlan, launched: Launched, every_running: bool = False) -> StepOutput:
        try:
            return self.executor.collect(launched) if launched.pending is not None else launched.output
        except ExecutorFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - outside the per-sequence guards
            return self._step_failed(plan, exc, every_running)

    def _step_failed(self, plan: StepPlan, exc: Exception, every_running: bool) -> StepOutput:
        log.exception("engine step failed", exc_info=exc)
        message = f"exception occurred during generation: {exc}"
        failed = [s.seq_id for s in self.scheduler.running] if every_running else [r.seq_id for r in plan.batch.rows]
        return StepOutput(errors=dict.fromkeys(failed, message))

    def _launch(self, plan: StepPlan) -> Launched:
        """The model work of `plan`: its plain-data batch handed to the executor (the constrained rows'
        grammar bitmask filled first)."""
        batch = plan.batch
        failed: dict[int, str] = {}
        if batch.grammar_rows and not batch.mask_later:  # (else after the step before it: `sample_held`)
            batch.grammar_bitmask, failed = self._masks.fill(plan, batch.grammar_rows)
            batch.grammar_rows = [] if failed else batch.grammar_rows
        if self.adapters is not None:  # the adapter loads let go: the runner's side forgets them
            batch.dropped_adapters = self.adapters.take_dropped()
        launched = self.executor.launch(batch)
        fail_rows(launched.output, failed)
        return launched

    def _plan(self, ahead: bool = False) -> StepPlan:
        """Plan the next step (`ahead`: while the one before it runs); the requests that timed out in the
        queue or were aborted end now."""
        now = time.monotonic()
        for seq in self.scheduler.expire(now):
            self._fail_before_start(seq.seq_id, QueueTimeout(f"Time out in: {self._timeout_text()}"))
        plan, events = self.scheduler.schedule(now, ahead=ahead)
        self._stamp(events, now)  # aborts: no tokens
        self._deliver(events)
        return plan

    async def _step(self) -> None:
        if self.async_scheduling:
            await self._step_overlapped()
            return
        scheduler = self.scheduler
        self._wakeup.clear()
        plan = self._plan()
        if not plan.has_model_work:
            if plan.batch.finished or plan.batch.preempted:  # the executor forgets what it kept of them
                await self.thread.run(self._run_guarded, plan)  # (its answer collected: nothing was computing)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), scheduler.next_wakeup(time.monotonic()))
            return
        started = time.monotonic()
        output, events = await self.thread.run(self._execute, plan)
        self._finish_step(plan, output, events, started)

    async def _step_overlapped(self) -> None:
        """One step with overlap scheduling: the step planned ahead (or, when none was, one planned now)
        runs on the torch thread while the loop plans the step after it and queues it there (when the
        scheduler allows: `BlockScheduler.can_plan_ahead`), then applies this step's results and delivers
        its events while the queued step runs. So the host's planning and the per-token work of a step
        (detokenizing, stop strings, the events) overlap the model's next step instead of following it.
        A step launched with its tokens still on their way (`Launched.pending`) is collected after the queued
        step is launched (which takes them on the device): the device runs on without waiting for the host."""
        current, self._ahead = self._ahead, None
        if current is None:
            self._wakeup.clear()
            plan = self._plan()
            if not plan.has_model_work and not (plan.batch.finished or plan.batch.preempted):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self.scheduler.next_wakeup(time.monotonic()))
                return
            current = _InFlight(plan, self.thread.submit(self._launch_guarded, plan), time.monotonic())
        if current.plan.has_model_work and self.scheduler.can_plan_ahead():
            ahead = self._plan(ahead=True)
            if ahead.has_model_work or ahead.batch.finished or ahead.batch.preempted:
                self._ahead = _InFlight(ahead, self.thread.submit(self._launch_guarded, ahead), time.monotonic())
                self.steps_ahead += ahead.has_model_work
        self._current = current
        launched = await current.launched
        held = await current.masked if current.masked is not None else None
        output = launched.output
        if launched.pending is not None:
            output = await self.thread.submit(self._collect_guarded, current.plan, launched)
        if held is not None:
            add_held(output, held)
        self._current = None
        if not current.plan.has_model_work:  # the executor only forgot requests
            return
        events = self.scheduler.update(current.plan, output)
        if self._ahead is not None and self._ahead.plan.batch.mask_later:  # its masks follow these tokens
            self._ahead.masked = self.thread.submit(self._masks.sample_held, self._ahead.plan)
        self._finish_step(current.plan, output, events, max(current.submitted, self._last_done))

    def _finish_step(
        self, plan: StepPlan, output: StepOutput, events: list[tuple[Sequence, StepEvent]], started: float
    ) -> None:
        """A model step's results applied: its events stamped and delivered, the observers told."""
        now = self._last_done = time.monotonic()
        self.steps += 1
        firsts, gaps = self._stamp(events, now)
        self.generated_tokens += len(firsts) + len(gaps)  # one of the two per token sampled
        if self._observers:
            prompt_tokens = prompt_tokens_computed(plan, output)
            step = StepStats(
                method="prefill" if plan.prefill else "decode",
                duration=now - started,
                rows=len(plan.decode) + len(plan.prefill),
                prompt_tokens=prompt_tokens,
                generated_tokens=len(firsts) + len(gaps),
                first_token_latencies=firsts,
                inter_token_latencies=gaps,
                prefix_queried_tokens=plan.prefix_queried,
                prefix_hit_tokens=plan.prefix_hits,
            )
            self._notify("on_step", step)
        self._deliver(events)

    _stamp = staticmethod(stamp_events)

    def _deliver(self, events: list[tuple[Sequence, StepEvent]]) -> None:
        """Each event onto its request's queue, or held for `stream_interval` (`RequestHandle.offer`)."""
        interval = self.config.stream_interval
        for n, (seq, event) in enumerate(events):
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue
            if event.finish is None:  # `more`: the sequence's next token is in this step too (drafts)
                handle.offer(seq.seq_id, event, interval, more=n + 1 < len(events) and events[n + 1][0] is seq)
                continue
            del self._handles[seq.seq_id]
            handle.unfinished -= 1
            if handle.unfinished == 0:
                self._report(handle)
            if event.finish.reason is FinishReason.ABORT:
                continue
            log.debug(
                "finished: %s after %d token(s)",
                event.finish.reason.value,
                event.finish.generated_tokens,
                extra={"request_id": seq.request_id},
            )
            handle.deliver(seq.seq_id, event)

    def _fail_before_start(self, seq_id: int, error: BaseException) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            self._report(handle, error)
            handle.fail(error)

    def _report(self, handle: RequestHandle, error: BaseException | None = None) -> None:
        """Tell the observers that `handle`'s request ended (once); its adapter is released."""
        if handle.reported:
            return
        handle.reported = True
        self._release(handle)
        handle.stats = request_stats(handle, time.monotonic(), error)
        self._notify("on_finished", handle.stats)

    def _timeout_text(self) -> str:
        value = self.config.predict_timeout
        return str(int(value)) if value is not None and float(value).is_integer() else str(value)
