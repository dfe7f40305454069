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
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lmiserve.core import request_context
from lmiserve.core.aio import cancel_and_wait
from lmiserve.core.errors import (
    AdapterNotFound,
    GenerationFailed,
    InvalidRequest,
    LmiServeError,
    ModelNotReady,
    Overloaded,
    QueueTimeout,
    ShuttingDown,
    excerpt,
)
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest
from lmiserve.core.request_context import Generation
from lmiserve.core.stats import EngineObserver, EngineSnapshot, RequestStats, SequenceStats, StepStats
from lmiserve.core.tokenizer import tokenizing
from lmiserve.engine import torch_thread
from lmiserve.engine.block_scheduler import BlockScheduler
from lmiserve.engine.grammar_compiler import CompiledGrammar, GrammarCompiler
from lmiserve.engine.kv_blocks import BlockPool
from lmiserve.engine.lora import AdapterError, LoraAdapter
from lmiserve.engine.lora_registry import AdapterRegistry, LoraLimits, UnknownAdapter
from lmiserve.engine.scheduler import StepPlan
from lmiserve.engine.sequence import Sequence
from lmiserve.engine.speculative import SpeculationPolicy, SpeculationSettings
from lmiserve.engine.step import BatchRunner, Executor, ExecutorFailed, InProcessExecutor, StepOutput
from lmiserve.engine.token_mask import TokenMask
from lmiserve.engine.validation import PromptCodec

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_running: int = 32
    max_prefill_tokens: int = 2048
    # tokens a step computes, decode rows included (vLLM's max_num_batched_tokens; None = no such bound)
    max_step_tokens: int | None = None
    job_queue_size: int = 1000
    predict_timeout: float | None = 120.0
    static_batching: bool = False
    batch_size: int = 1
    max_batch_delay: float = 0.1
    batch_invariant: bool = False
    fast_path: bool = True  # own Llama-family forward when supported; False forces the generic path
    cpu_autotune: bool = False  # time the fast path's CPU kernel choices at start-up (engine/autotune.py)
    autotune_cache: str | None = None  # its JSON cache; None = <user cache dir>/lmiserve/autotune.json
    # prompt tokens a step that also decodes may take: max(this, decoding rows, max_running - decoding rows);
    # None = no extra bound; "auto" = by device (engine/factory.py)
    prefill_floor: int | Literal["auto"] | None = "auto"
    # prefix caching: a prompt starts from the pool's blocks of an earlier one with the same head (the KV
    # pool is the cache; never with batch_invariant)
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # the paged pool's budget; None = by device (engine/factory.py)
    block_size: int = 16  # tokens a block of the paged pool holds
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of the GPU the paged pool's default budget fills
    enforce_eager: bool = False  # on CUDA: no decode steps replayed as CUDA graphs (engine/attention/cuda_graphs.py)
    speculation: SpeculationSettings | None = None  # speculative decoding (engine/speculative.py)
    lora: LoraLimits | None = None  # LoRA adapters (engine/lora_registry.py; None: none served)


def _prompt_tokens_computed(plan: StepPlan, output: StepOutput) -> int:
    """Prompt tokens the step computed for the first time (a preempted sequence's recompute, and the
    generated tokens a recompute includes, are not prompt tokens processed again)."""
    total = 0
    for chunk in plan.prefill:
        seq = chunk.seq
        if seq.seq_id in output.errors:
            continue
        start, end = max(chunk.start, seq.prompt_counted), min(chunk.start + chunk.length, seq.prompt_len)
        if end > start:
            total += end - start
            seq.prompt_counted = end
    return total


class _Handle:
    """One submitted request: its sequences and the queue their events (or its error) arrive on."""

    def __init__(self, request: GenerationRequest, seqs: list[Sequence], arrival: float) -> None:
        self.request = request
        self.seqs = seqs
        self.queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        self.open = len(seqs)  # sequences whose end the consumer has not read yet
        self.arrival = arrival
        self.unfinished = len(seqs)  # sequences whose end the engine has not delivered yet
        self.reported = False  # told the observers it ended
        self.stats: RequestStats | None = None  # its figures, once it ended
        self.adapter: LoraAdapter | None = None  # its LoRA adapter, held until it ended


class AsyncEngine:
    """The continuous-batching `TextGenerator` (lmiserve.core.engine) of one loaded LLM."""

    def __init__(
        self,
        runner: BatchRunner | Executor,
        codec: PromptCodec,
        config: EngineConfig,
        grammars: GrammarCompiler | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        """`runner`: the model's runner (run in this process), or an executor that runs the plain-data
        batches elsewhere (the tensor-parallel workers, engine/tp_workers.py); `adapters`: the LoRA
        adapters requests may name (`GenerationRequest.adapter`; None: none)."""
        floor = config.prefill_floor
        if floor == "auto":
            raise ValueError("prefill_floor 'auto' is resolved by the device (engine.factory.create_engine)")
        # this model's torch thread: the shared one on the CPU, its own on a GPU (engine/torch_thread.py)
        self.thread = torch_thread.for_device(getattr(runner, "device", "cpu"), f"engine-{id(self):x}")
        self.codec = codec
        self.grammars = grammars  # compiles the grammars of constrained requests (None: unsupported)
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
        self._grammar_mask: TokenMask | None = None  # the executor's batches' grammar bitmask
        # blocks computed in another step's shapes round differently: no sharing when batch-invariant
        caching = config.enable_prefix_caching and not config.batch_invariant
        self.pool = BlockPool(runner.num_blocks, runner.block_size, enable_prefix_caching=caching)
        self.scheduler = BlockScheduler(self.pool, config.max_running, config.max_prefill_tokens, **options)
        self.speculation: SpeculationPolicy | None = None
        if config.speculation is not None:
            self.speculation = self.scheduler.speculation = SpeculationPolicy(config.speculation)
        self.adapters = adapters
        if adapters is not None:
            self.scheduler.max_loras = adapters.limits.max_loras
        self._handles: dict[int, _Handle] = {}  # seq_id -> handle
        self._ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._observers: list[EngineObserver] = []
        self.steps = 0
        self.generated_tokens = 0  # since start, for `snapshot`
        self.failure: str | None = None  # why the engine core failed (`_die`); it serves nothing then
        self.on_failure: list[Callable[[str], None]] = []

    @property
    def runner(self) -> BatchRunner | None:
        """The model's runner when it runs in this process (None: the executor runs it elsewhere)."""
        return self.executor.runner if isinstance(self.executor, InProcessExecutor) else None

    def _check_fits(self, tokens: int) -> None:
        """A request whose KV (prompt + max new tokens) needs more blocks than the whole pool is refused."""
        pool = self.pool
        if pool.never_fits(tokens):
            raise InvalidRequest(
                f"the prompt and max_new_tokens need the KV cache of {tokens} tokens, more than the whole "
                f"KV cache holds ({pool.num_blocks * pool.block_size} tokens, kv_cache_memory_bytes)"
            )

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
        await asyncio.to_thread(self.executor.close)
        self.thread.close()
        if self.grammars is not None:
            self.grammars.close()
        for seq_id in list(self._handles):
            self._fail_before_start(seq_id, ShuttingDown())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- what observers see (lmiserve.core.stats) ----------------------------------------------------
    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def snapshot(self) -> EngineSnapshot:
        running = self.scheduler.running
        pool = self.pool  # vLLM's meaning: blocks in use / the pool
        kv_tokens, kv_capacity = pool.num_used_blocks * pool.block_size, pool.num_blocks * pool.block_size
        return EngineSnapshot(
            running=len(running),
            waiting=len(self.scheduler.waiting),
            batch_max_tokens=sum(s.prompt_len + s.params.max_new_tokens for s in running),
            kv_tokens=kv_tokens,
            kv_capacity=kv_capacity,
            batch_slots=self.scheduler.max_running,
            generated_tokens=self.generated_tokens,
            preemptions=getattr(self.scheduler, "num_preemptions", 0),
            kv_blocks=pool.num_blocks,
            kv_block_size=pool.block_size,
            speculation=self.speculation.describe() if self.speculation is not None else None,
            lora_running=_adapter_names(running) if self.adapters is not None else (),
            lora_waiting=_adapter_names(self.scheduler.waiting) if self.adapters is not None else (),
            max_loras=self.adapters.limits.max_loras if self.adapters is not None else 0,
            **self._prefix_figures(),
        )

    def _prefix_figures(self) -> dict[str, int]:
        """What the prefix cache holds and can hold, in tokens, and its memory: its registered blocks of
        the whole pool (the pool is the cache)."""
        pool = self.pool
        if not pool.enable_prefix_caching:
            return {"prefix_cache_tokens": 0, "prefix_cache_capacity": 0, "prefix_cache_bytes": 0}
        return {
            "prefix_cache_tokens": pool.num_cached_blocks * pool.block_size,
            "prefix_cache_capacity": pool.num_blocks * pool.block_size,
            "prefix_cache_bytes": self.executor.kv_bytes,
        }

    def _notify(self, method: str, *args: object) -> None:
        for observer in self._observers:
            try:
                getattr(observer, method)(*args)
            except Exception:  # noqa: BLE001 - a failing observer must not fail requests or the loop
                log.exception("engine observer %s.%s failed", type(observer).__name__, method)

    # ---- requests ----------------------------------------------------------------------------------
    async def prepare(self, request: GenerationRequest) -> None:
        """Refuse here, before anything is generated, what `submit` would refuse of the request itself:
        its grammar is compiled off the engine thread (cached; InvalidRequest when it does not compile),
        its prompt encoded and checked (the context length, ids outside the vocabulary) and its KV, prompt
        plus max_new_tokens, checked against the whole pool (`_check_fits`). `generate` does it all
        again, from the caches (the grammar's, and this request's encoding of its prompt: tokenized
        once); a protocol calls this first to answer such a request with its 4xx before its response
        (a stream's 200) starts."""
        await self._compile(request.params.grammar)
        _, prompt_ids = await self._encode(request)
        try:
            if prompt_ids is None:  # given as ids, or this request's encoding is remembered: no tokenizing
                prompt_ids = self.codec.encode(request)
            self._check_fits(len(prompt_ids) + request.params.max_new_tokens)
        except LmiServeError as exc:
            self._notify("on_rejected", exc)
            raise

    async def _compile(self, grammar: Grammar | None) -> CompiledGrammar | None:
        if grammar is None:
            return None
        if self.grammars is None:
            raise InvalidRequest("structured output (grammar) is not supported for this model")
        return await self.grammars.compile_async(grammar)

    def _acquire(self, name: str | None) -> LoraAdapter | None:
        """The adapter a request names, held for the request (None: the base model); AdapterNotFound or
        InvalidRequest (its files no longer load)."""
        if name is None:
            return None
        if self.adapters is None:
            raise AdapterNotFound(f"adapter `{name}` is not served: this model serves no LoRA adapters (enable_lora)")
        try:
            return self.adapters.acquire(name)
        except UnknownAdapter:
            raise AdapterNotFound(f"adapter `{excerpt(name)}` is not served") from None
        except AdapterError as exc:
            raise InvalidRequest(f"adapter `{name}` cannot be loaded: {exc}") from None

    async def _acquire_async(self, request: GenerationRequest) -> LoraAdapter | None:
        """`_acquire`, on a worker thread when the adapter's files must be read first."""
        name = request.adapter
        try:
            if name is not None and self.adapters is not None and self.adapters.needs_load(name):
                return await asyncio.to_thread(self._acquire, name)
            return self._acquire(name)
        except LmiServeError as exc:
            self._notify("on_rejected", exc)
            raise

    def _release(self, handle: _Handle) -> None:
        adapter, handle.adapter = handle.adapter, None
        self._release_adapter(adapter)

    def _release_adapter(self, adapter: LoraAdapter | None) -> None:
        if adapter is not None and self.adapters is not None:
            self.adapters.release(adapter)

    def submit(
        self,
        request: GenerationRequest,
        grammar: CompiledGrammar | None = None,
        prompt_ids: list[int] | None = None,
        adapter: LoraAdapter | None = None,
    ) -> _Handle:
        """Validate, tokenize and enqueue; raises InvalidRequest or Overloaded at once. A request with a
        grammar needs it compiled (`grammar`, from `prepare`'s cache when not given: compiled here on
        a cache miss); `prompt_ids`: the request already encoded (`_encode`), else encoded here;
        `adapter`: its LoRA adapter already acquired (`_acquire_async`; the handle releases it), else
        acquired here."""
        arrival = time.monotonic()
        try:
            if self.failure is not None:
                raise ModelNotReady(f"The model cannot serve: {self.failure}")
            if adapter is None and request.adapter is not None:
                adapter = self._acquire(request.adapter)
        except LmiServeError as exc:
            self._notify("on_rejected", exc)
            raise
        try:
            return self._enqueue(request, grammar, prompt_ids, adapter, arrival)
        except BaseException:
            self._release_adapter(adapter)
            raise

    def _enqueue(
        self,
        request: GenerationRequest,
        grammar: CompiledGrammar | None,
        prompt_ids: list[int] | None,
        adapter: LoraAdapter | None,
        arrival: float,
    ) -> _Handle:
        try:
            if grammar is None and request.params.grammar is not None:
                if self.grammars is None:
                    raise InvalidRequest("structured output (grammar) is not supported for this model")
                grammar = self.grammars.compile(request.params.grammar)
            if prompt_ids is None:
                prompt_ids = self.codec.encode(request)
            request = self.codec.runnable(request)  # its bad words and thinking end as ids (done by `_encode`)
            count = max(request.params.n, request.params.best_of)
            self._check_fits(len(prompt_ids) + request.params.max_new_tokens)
            if len(self.scheduler.waiting) + count > self.config.job_queue_size:
                raise Overloaded("Worker queue capacity exceeded")
        except LmiServeError as exc:
            self._notify("on_rejected", exc)
            raise
        base_seed = request.params.seed if request.params.seed is not None else _random_seed()
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
                arrival=arrival,
                grammar=grammar.matcher() if grammar is not None else None,  # each sequence its own
                priority=request.priority,
            )
            for i in range(count)
        ]
        handle = _Handle(request, seqs, arrival)
        handle.adapter = adapter
        # blocks computed with an adapter are shared only with requests of the same load of that adapter
        salt = request.cache_salt if adapter is None else f"{request.cache_salt or ''}\x00lora:{adapter.id}"
        for seq in seqs:
            seq.cache_salt = salt
            seq.adapter = adapter
            self._handles[seq.seq_id] = handle
            self.scheduler.add(seq)
        self._notify("on_submitted", len(prompt_ids), count)
        self._wakeup.set()
        log.debug(
            "queued: %d prompt tokens, %d sequence(s), %d waiting",
            len(prompt_ids),
            count,
            len(self.scheduler.waiting),
            extra={"request_id": request.request_id},
        )
        return handle

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        """Events of one request. With n/best_of > 1 the sequences come whole, best first, unless the
        request is not `ranked` (then as they are generated, interleaved)."""
        grammar = await self._compile(request.params.grammar)
        request, prompt_ids = await self._encode(request)
        handle = self.submit(request, grammar, prompt_ids, await self._acquire_async(request))
        try:
            if len(handle.seqs) == 1 or (not request.ranked and request.params.n == len(handle.seqs)):
                async for event in self._drain(handle):
                    yield event
            else:
                for event in await self._collect_ranked(handle):
                    yield event
        finally:
            self.abort(handle)
            self._record(handle)

    @staticmethod
    def _record(handle: _Handle) -> None:
        """Add the request's settings and times to the facts of the request being served (the traces'
        spans are made of them): its figures if it ended, else (its client left) as they stand now."""
        if request_context.current() is None:
            return
        params = handle.request.params
        stats = handle.stats if handle.stats is not None else _request_stats(handle, time.monotonic(), None)
        temperature = params.temperature if params.do_sample else 0.0
        request_context.record_generation(Generation(params.max_new_tokens, temperature, params.top_p, stats))

    async def _encode(self, request: GenerationRequest) -> tuple[GenerationRequest, list[int] | None]:
        """The request as the engine runs it (`PromptCodec.runnable`) and its prompt ids, tokenized on the
        tokenizer thread (off the event loop); the ids None when encoding needs no tokenizer (ids given, or
        counted by this request's validation): `submit` takes them then."""
        if self.codec.tokenized(request):
            return request, None
        try:
            return await tokenizing(self.codec.encode_request, request)
        except LmiServeError as exc:
            self._notify("on_rejected", exc)
            raise

    def abort(self, handle: _Handle) -> None:
        unfinished = [seq for seq in handle.seqs if not seq.finished]
        for seq in unfinished:
            self.scheduler.abort(seq)
        if unfinished:
            log.debug("aborted: %d sequence(s)", len(unfinished), extra={"request_id": handle.request.request_id})
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
        ranked = sorted(handle.seqs, key=_mean_logprob, reverse=True)
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
        for listener in self.on_failure:
            try:
                listener(self.failure)
            except Exception:  # noqa: BLE001 - a listener must not hide the failure from the others
                log.exception("engine failure listener failed")

    def _execute(self, plan: StepPlan) -> tuple[StepOutput, list[tuple[Sequence, StepEvent]]]:
        """Run `plan` and apply its results (on the torch thread): the model step, then the scheduler's
        update, whose per-token work (detokenizing, stop strings, grammar matchers, building the events)
        so stays off the HTTP event loop; the loop only delivers the events. Meanwhile the loop may only
        add to the waiting queue and flag aborts, which `update` does not touch."""
        try:
            output = self._run(plan)
        except ExecutorFailed:
            raise  # the engine fails (`_loop`), not the step
        except Exception as exc:  # noqa: BLE001 - outside the per-sequence guards: end what was running
            log.exception("engine step failed")
            message = f"exception occurred during generation: {exc}"
            output = StepOutput(errors={s.seq_id: message for s in self.scheduler.running})
        return output, self.scheduler.update(plan, output)

    def _run(self, plan: StepPlan) -> StepOutput:
        """The model work of `plan`: its plain-data batch through the executor (the constrained rows'
        grammar bitmask filled first)."""
        executor, batch = self.executor, plan.batch
        failed: dict[int, str] = {}
        if batch.grammar_rows:
            seqs = plan.decode + [chunk.seq for chunk in plan.prefill]  # the batch's row order
            matchers = [seqs[i].grammar for i in batch.grammar_rows]
            try:
                if self._grammar_mask is None:
                    self._grammar_mask = TokenMask(executor.vocab_size, executor.eos_token_ids)
                batch.grammar_bitmask = self._grammar_mask.fill([m for m in matchers if m is not None]).numpy().copy()
            except Exception as exc:  # noqa: BLE001 - the constrained rows fail, the others go on
                log.exception("filling the grammar bitmask failed")
                failed = {seqs[i].seq_id: f"exception occurred during sampling: {exc}" for i in batch.grammar_rows}
                batch.grammar_rows, batch.grammar_bitmask = [], None
        if self.adapters is not None:  # the adapter loads let go: the runner's side forgets them
            batch.dropped_adapters = self.adapters.take_dropped()
        output = executor.execute(batch)
        for seq_id, message in failed.items():
            output.samples.pop(seq_id, None)
            output.errors[seq_id] = message
        return output

    async def _step(self) -> None:
        scheduler = self.scheduler
        self._wakeup.clear()
        now = time.monotonic()
        for seq in scheduler.expire(now):
            self._fail_before_start(seq.seq_id, QueueTimeout(f"Time out in: {self._timeout_text()}"))
        plan, events = scheduler.schedule(now)
        self._stamp(events, now)  # aborts: no tokens
        self._deliver(events)
        if not plan.has_model_work:
            if plan.batch.finished or plan.batch.preempted:  # the executor forgets what it kept of them
                try:
                    await self.thread.run(self._run, plan)
                except ExecutorFailed:
                    raise
                except Exception:  # noqa: BLE001 - nothing was computing
                    log.exception("engine step failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), scheduler.next_wakeup(time.monotonic()))
            return
        started = time.monotonic()
        output, events = await self.thread.run(self._execute, plan)
        now = time.monotonic()
        self.steps += 1
        firsts, gaps = self._stamp(events, now)
        self.generated_tokens += len(firsts) + len(gaps)  # one of the two per token sampled
        if self._observers:
            prompt_tokens = _prompt_tokens_computed(plan, output)
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

    @staticmethod
    def _stamp(events: list[tuple[Sequence, StepEvent]], now: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Record when each sequence got a token or ended; this step's times to first token and
        inter-token latencies."""
        firsts, gaps = [], []
        for seq, event in events:
            if event.token is not None:
                if seq.last_token_at is None:
                    seq.first_token_at = now
                    firsts.append(now - seq.arrival)
                else:
                    gaps.append(now - seq.last_token_at)
                seq.last_token_at = now
            if event.finish is not None:
                seq.finished_at = now
        return tuple(firsts), tuple(gaps)

    def _deliver(self, events: list[tuple[Sequence, StepEvent]]) -> None:
        for seq, event in events:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue
            if event.finish is not None:
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
            handle.queue.put_nowait(event)

    def _fail_before_start(self, seq_id: int, error: BaseException) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            self._report(handle, error)
            handle.queue.put_nowait(error)

    def _report(self, handle: _Handle, error: BaseException | None = None) -> None:
        """Tell the observers that `handle`'s request ended (once); its adapter is released."""
        if handle.reported:
            return
        handle.reported = True
        self._release(handle)
        handle.stats = _request_stats(handle, time.monotonic(), error)
        self._notify("on_finished", handle.stats)

    def _timeout_text(self) -> str:
        value = self.config.predict_timeout
        return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def _request_stats(handle: _Handle, now: float, error: BaseException | None) -> RequestStats:
    """`handle`'s request as the observers see it when it ends (a sequence not ended yet ends `now`)."""
    fallback = FinishReason.ABORT if error is None else FinishReason.ERROR
    sequences = tuple(
        SequenceStats(
            arrival=handle.arrival,
            scheduled=seq.scheduled_at,
            first_token=seq.first_token_at,
            finished=seq.finished_at if seq.finished_at is not None else now,
            prompt_tokens=seq.prompt_len,
            generated_tokens=len(seq.output_ids),
            max_new_tokens=seq.params.max_new_tokens,
            reason=seq.finish_reason if seq.finish_reason is not None else fallback,
            cached_tokens=seq.cached_tokens,
        )
        for seq in handle.seqs
    )
    prompt_tokens = handle.seqs[0].prompt_len if handle.seqs else 0
    return RequestStats(handle.arrival, now, prompt_tokens, sequences, error)


def _random_seed() -> int:
    """A random non-negative signed 32-bit seed, drawn per request when the client gives none."""
    return random.SystemRandom().randrange(0, 2**31)


def _mean_logprob(seq: Sequence) -> float:
    """The one best-of rule, every protocol's: the highest log probability per generated token (OpenAI's
    `best_of` and TGI's); a sequence without a token ranks last."""
    return seq.cumulative_logprob / len(seq.output_ids) if seq.output_ids else float("-inf")


def _reindex(event: StepEvent, index: int) -> StepEvent:
    return StepEvent(token=event.token, top_tokens=event.top_tokens, finish=event.finish, index=index)


def _adapter_names(seqs: Iterable[Any]) -> tuple[str, ...]:
    """The adapters of `seqs` by name, sorted, each once (vLLM's lora_requests_info)."""
    return tuple(sorted({s.adapter.name for s in list(seqs) if s.adapter is not None}))
