"""The asyncio engine's request side: one background task (core/engine_core.py) drives the scheduler; model
steps run on the model's torch thread.

Requests are validated and tokenized in `submit`, wait FIFO (up to `job_queue_size`), join the running
batch at the next step, and receive their events through a per-request queue. A client that stops
iterating (disconnect -> CancelledError/GeneratorExit) aborts its sequences, which leave the batch at
the next step. One request's failure reaches that request only; the loop survives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator

from lmiserve.core import request_context
from lmiserve.core.errors import (
    AdapterNotFound,
    InvalidRequest,
    LmiServeError,
    ModelNotReady,
    Overloaded,
    excerpt,
)
from lmiserve.core.events import StepEvent
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest
from lmiserve.core.request_context import Generation
from lmiserve.core.stats import EngineSnapshot
from lmiserve.core.tokenizer import tokenizing
from lmiserve.engine.core.config import EngineConfig
from lmiserve.engine.core.engine_core import EngineCore
from lmiserve.engine.core.handles import RequestHandle, adapter_names, mean_logprob, random_seed, reindex, request_stats
from lmiserve.engine.core.sequence import Sequence
from lmiserve.engine.core.step import BatchRunner, Executor
from lmiserve.engine.lora.adapters import AdapterError, LoraAdapter
from lmiserve.engine.lora.registry import AdapterRegistry, UnknownAdapter
from lmiserve.engine.text.grammar_compiler import CompiledGrammar, GrammarCompiler
from lmiserve.engine.text.validation import PromptCodec

__all__ = ["AsyncEngine", "EngineConfig"]

log = logging.getLogger(__name__)


class AsyncEngine(EngineCore):
    """The continuous-batching `TextGenerator` (lmiserve.core.engine) of one loaded LLM: requests are
    prepared (grammar compiled, prompt encoded and checked), submitted to the core's scheduler and their
    events read from their queues."""

    def __init__(
        self,
        runner: BatchRunner | Executor,
        codec: PromptCodec,
        config: EngineConfig,
        grammars: GrammarCompiler | None = None,
        adapters: AdapterRegistry | None = None,
        warmup_rows: tuple[int, ...] = (1,),
    ) -> None:
        """`runner`: the model's runner (run in this process), or an executor that runs the plain-data
        batches elsewhere (the tensor-parallel workers, engine/executors/tensor_parallel.py); `adapters`: the LoRA
        adapters requests may name (`GenerationRequest.adapter`; None: none); `warmup_rows`: the decode row
        counts the runner distinguishes (its CUDA graph sizes), each of which a warm-up runs (engine/core/warmup.py)."""
        super().__init__(runner, config, adapters)
        self.codec = codec
        self.grammars = grammars  # compiles the grammars of constrained requests (None: unsupported)
        self._ids = itertools.count(1)
        self.warmup_rows = warmup_rows

    async def stop(self) -> None:
        """Stop the loop (requests still open end with an error) and the grammar compiler."""
        await super().stop()
        if self.grammars is not None:
            self.grammars.close()

    # ---- what observers see (lmiserve.core.stats) ----------------------------------------------------
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
            model_steps=self.steps,
            steps_planned_ahead=self.steps_ahead,
            kv_blocks=pool.num_blocks,
            kv_block_size=pool.block_size,
            speculation=self.speculation.describe() if self.speculation is not None else None,
            lora_running=adapter_names(running) if self.adapters is not None else (),
            lora_waiting=adapter_names(self.scheduler.waiting) if self.adapters is not None else (),
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

    def _release(self, handle: RequestHandle) -> None:
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
    ) -> RequestHandle:
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
    ) -> RequestHandle:
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
        images = getattr(prompt_ids, "images", None)  # a VLM prompt's images (engine/text/images.py)
        if images is not None:
            prompt_ids = list(prompt_ids)  # the sequences keep them apart from the ids
        base_seed = request.params.seed if request.params.seed is not None else random_seed()
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
        handle = RequestHandle(request, seqs, arrival)
        handle.adapter = adapter
        # blocks computed with an adapter are shared only with requests of the same load of that adapter
        salt = request.cache_salt if adapter is None else f"{request.cache_salt or ''}\x00lora:{adapter.id}"
        for seq in seqs:
            seq.cache_salt = salt
            seq.adapter = adapter
            seq.images = images
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
    def _record(handle: RequestHandle) -> None:
        """Add the request's settings and times to the facts of the request being served (the traces'
        spans are made of them): its figures if it ended, else (its client left) as they stand now."""
        if request_context.current() is None:
            return
        params = handle.request.params
        stats = handle.stats if handle.stats is not None else request_stats(handle, time.monotonic(), None)
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

    def abort(self, handle: RequestHandle) -> None:
        unfinished = [seq for seq in handle.seqs if not seq.finished]
        for seq in unfinished:
            self.scheduler.abort(seq)
        if unfinished:
            log.debug("aborted: %d sequence(s)", len(unfinished), extra={"request_id": handle.request.request_id})
        self._wakeup.set()

    def events(self, handle: RequestHandle) -> AsyncGenerator[StepEvent, None]:
        """The events of a request `submit` queued (of one sequence), to its end."""
        return self._drain(handle)

    async def _drain(self, handle: RequestHandle) -> AsyncGenerator[StepEvent, None]:
        while handle.open:
            item = await handle.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish is not None:
                handle.open -= 1
            yield item

    async def _collect_ranked(self, handle: RequestHandle) -> list[StepEvent]:
        by_index: dict[int, list[StepEvent]] = {s.index: [] for s in handle.seqs}
        async for event in self._drain(handle):
            by_index[event.index].append(event)
        params = handle.request.params
        ranked = sorted(handle.seqs, key=mean_logprob, reverse=True)
        keep = params.n
        events: list[StepEvent] = []
        for new_index, seq in enumerate(ranked[:keep]):
            events.extend(reindex(e, new_index) for e in by_index[seq.index])
        return events
