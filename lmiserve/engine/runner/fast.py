"""The fast strategy over a block KV cache (Engine v2): lmiserve's own Llama-family forward
(engine/model/fast_llama.py) reading and writing each sequence's KV through its block table
(engine/attention/paged.py), planned by the block scheduler (engine/core/block_scheduler.py).

It runs the step contract's plain-data batches (engine/core/step.py, `execute_batch`) and keeps the
persistent batch: for each request it was told of, its prompt, sampled tokens, parameters, generator
and block table, updated by each batch's difference and forgotten when the request is finished.

The pool of blocks is sized at start-up from a memory budget (`kv_cache_memory_bytes`); the scheduler's
`BlockPool` and this runner's `PagedKVCache` have the same number of blocks, the one bookkeeping the
other's memory. Nothing is ever copied between sequences: shared prefix blocks are read in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import PagedKVCache, paged_cache
from lmiserve.engine.core.step import PENDING_TOKEN, ScheduledTokens, StepBatch
from lmiserve.engine.lora.batch import LoraBatch, LoraGroup
from lmiserve.engine.model import autotune as kernel_autotune
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
from lmiserve.engine.runner.request_state import RequestState

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lmiserve.engine.attention.cuda_graphs import DecodeGraphs
    from lmiserve.engine.runner.graph_sampling import GraphRow

log = logging.getLogger(__name__)

GREEDY = SamplingParams()  # what a decode graph samples for a row it does not sample: its argmax


def fast_forward(
    model: Any,
    kv: PagedKVCache,
    max_context: int,
    max_slots: int,
    autotune: tuple[bool, str | None],
    graphs: int | None,
) -> tuple[FastLlama, kernel_autotune.KernelChoice, DecodeGraphs | None]:
    """lmiserve's forward of `model` (a causal LM, or a VLM's decoder seen as one) over `kv`: with its CPU
    kernels timed at start-up where `autotune` says so (``(on, cache file)``, engine/model/autotune.py; else the
    static choice), and its decode graphs where `graphs` is not None (their prompt tokens; the pool's last block
    is their scratch block)."""
    fast = FastLlama(model, kv, max_context)
    if autotune[0]:
        start = time.monotonic()
        kernels = kernel_autotune.choose(fast, max_slots, autotune[1])
        log.info("CPU kernels (%.1f s): %s", time.monotonic() - start, kernels.describe())
    else:
        kernels = kernel_autotune.KernelChoice(fast.gemm, fast.compiled_attention, "static")
    scratch = kv.num_blocks - 1
    fast.graphs = cuda_graphs.for_model(fast, max_slots, scratch, graphs) if graphs is not None else None
    return fast, kernels, fast.graphs


def step_inputs(
    batch: StepBatch,
    part: list[int],
    requests: dict[int, RequestState],
    kept: Callable[[ScheduledTokens], int],
    chained: dict[int, int],
    lora: LoraBatch | None,
) -> StepInputs:
    """The fast forward's step of rows `part` of `batch` (its decode rows first): each row's tokens over its
    request's blocks, the logits `kept` of each prompt chunk's last tokens, a `chained` row's input on the device."""
    decode = [i for i in part if i < batch.num_decode]
    keep = list(range(len(decode)))
    offset = len(decode)
    prefills = []
    for i in part[len(decode) :]:
        row = batch.rows[i]
        computed = row.computed_ids
        prefills.append((requests[row.seq_id].blocks, row.start, computed))
        keep.extend(range(offset + len(computed) - kept(row), offset + len(computed)))
        offset += len(computed)
    rows = [batch.rows[i] for i in decode]
    return StepInputs(
        [0 if r.seq_id in chained else r.token_ids[0] for r in rows],  # (chained: on the device)
        [r.start for r in rows],
        [requests[r.seq_id].blocks for r in rows],
        prefills,
        keep,
        lora,
        [chained.get(r.seq_id, -1) for r in rows] if chained else None,
    )


class PagedFastRunner(PersistentBatchRunner):
    path = "fast"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_slots: int,
        max_context: int,
        eos_token_ids: Iterable[int],
        num_blocks: int,
        block_size: int,
        autotune: bool = False,
        autotune_cache: str | None = None,
        enforce_eager: bool = False,
        kv_format: KvFormat | None = None,
        graph_prompt_tokens: int = 0,
    ) -> None:
        """`max_slots`: the most rows a step runs; `autotune`: time the CPU kernel choices at start-up (or
        read them from `autotune_cache`, engine/model/autotune.py), otherwise the static defaults;
        `enforce_eager`: no CUDA graphs for decode steps (engine/attention/cuda_graphs.py; on CUDA they are the
        default where they apply); `kv_format`: how the pool stores keys and values (default the model's
        dtype; `kv_cache_dtype=fp8`, engine/attention/kv_quant.py); `graph_prompt_tokens`: a step's prompt
        chunks of up to this many tokens replay the decode graphs too (their sizes reach `max_slots` plus it)."""
        graphs = cuda_graphs.wanted(model.device, enforce_eager)
        # with decode graphs, one block past the pool's: where their padding rows write (no sequence holds it)
        kv = paged_cache(model, num_blocks + int(graphs), block_size, kv_format)
        self.fast, self.kernels, self.graphs = fast_forward(
            model, kv, max_context, max_slots, (autotune, autotune_cache), graph_prompt_tokens if graphs else None
        )
        self.max_slots = max_slots
        super().__init__(model, eos_token_ids, kv, num_blocks)

    # ---- the step contract (engine/core/step.py): one forward of a batch's rows ---------------------
    def _forward_rows(self, batch: StepBatch, part: list[int]) -> torch.Tensor:
        chained = self._chained
        lora = self._lora(batch, part, [1 if i < batch.num_decode else len(batch.rows[i].computed_ids) for i in part])
        step = step_inputs(batch, part, self._requests, self._kept, chained, lora)
        self._graph_sampled, marks = set(), []
        if not step.chunks:
            rows = [batch.rows[i] for i in part]
            marks = self._sample_in_graph(rows, lora, {batch.rows[i].seq_id for i in batch.grammar_rows})
        logits = self.fast.forward(step)
        if marks and self.graphs is not None and self.graphs.penalties_ran:  # (its graph marked their input tokens)
            self.penalties.taken_by_graph(marks)
        return logits

    def _sample_in_graph(self, rows: list[ScheduledTokens], lora: LoraBatch | None, grammar: set[int]) -> list[int]:
        """A step of decode rows alone that a graph replays, where some rows (without a grammar: the seq_ids in
        `grammar`) sample or are penalized with what a graph does (runner/graph_sampling.py): its graph samples
        them (`_graph_sampled`), each from its seed and the index of its token (a chained row's token in flight
        counted), a penalized one from its book slot, flushed up to the input token the graph marks. The rest
        are greedy rows to it: the picks of those greedy without processing are their argmax, the others' are
        dropped (the eager sampler takes them from the logits: `_graph_served`). The book slots to count as
        marked if the graph penalized."""
        graphs, requests, book = self.graphs, [self._requests[r.seq_id] for r in rows], self.penalties
        if graphs is None or not graphs.covers(len(rows), lora):
            return []
        chained, device = self._chained, self.fast.device
        indexes = [len(r.output_ids) + (row.seq_id in chained) for r, row in zip(requests, rows)]
        taken = [r.in_graph and row.seq_id not in grammar for r, row in zip(requests, rows)]
        slots: dict[int, int] = {}  # penalized rows' book slots, by row
        if book.dense(device) and any(r.penalized and t for r, t in zip(requests, taken)):
            book.pin(self.max_slots)
            slots = {n: self._penalty_slot(r) for n, (r, t) in enumerate(zip(requests, taken)) if r.penalized and t}
            book.flush(device, self.fast.logits_width, list(slots.values()), [indexes[n] - 1 for n in slots])
            # (the graph marks each input token; one before it not on the host is never expected: eager then)
            slots = {n: slot for n, slot in slots.items() if book.taken(slot) == indexes[n] - 1}
        wanted: list[GraphRow | None] = [
            (r.params, r.seed, indexes[n], slots.get(n), r.banned if indexes[n] < r.params.min_new_tokens else ())
            if taken[n] and (n in slots if r.penalized else not r.argmax)
            else None
            for n, r in enumerate(requests)
        ]
        if not any(wanted) or not graphs.sample([w or (GREEDY, None, 0, None, ()) for w in wanted], book):
            return []
        self._graph_sampled = {row.seq_id for row, w in zip(rows, wanted) if w}
        return [w[3] for w in wanted if w and w[3] is not None]

    def _chain_from(self, batch: StepBatch) -> dict[int, int] | None:
        """A step of decode rows alone, every one greedy without processing or (where the graphs sample)
        sampled in a graph, a top-N with either, with no more adapters than the graphs' LoRA slots, that the
        graphs replay chains from the last step in flight when that step ran every row whose token it waits for.
        (The slots' inputs are copied with the graphs' others, `DecodeGraphs._fill`: a chained step's wait
        for the copies of the step before covers them.)"""
        last, graphs, rows = self.in_flight.last, self.graphs, batch.rows
        if last is None or graphs is None or not graphs.covers(len(rows)):
            return None
        if batch.new or batch.preempted or batch.grammar_rows or self.proposer is not None:
            return None
        if batch.num_decode != len(rows) or any(r.draft_token_ids or r.prompt_logprobs for r in rows):
            return None
        requests = self._requests
        if not all(r.seq_id in requests and requests[r.seq_id].in_graph for r in rows):
            return None
        adapters = {a.id for a in (requests[r.seq_id].adapter for r in rows) if a is not None}
        if adapters and (graphs.lora is None or len(adapters) > graphs.lora.slots):  # (`covers`; the scheduler
            return None  # holds max_loras adapters at most, the slots' count)
        if not all(requests[r.seq_id].argmax for r in rows) and not graphs.samples:
            return None
        row_of = {seq_id: n for n, seq_id in enumerate(last.seq_ids)}
        waiting = [r.seq_id for r in rows if r.token_ids[0] == PENDING_TOKEN]
        if not all(seq_id in row_of for seq_id in waiting):
            return None
        return {seq_id: row_of[seq_id] for seq_id in waiting}

    def _send_pick(
        self, logits: torch.Tensor, sampled: bool = False, top_n: int = 0
    ) -> Callable[[], list[list[float]]] | None:
        return self.graphs.send_pick(logits, sampled, top_n) if self.graphs is not None else None

    def lora_groups(self, model: PreTrainedModel) -> list[LoraGroup]:
        return self.fast.lora_groups()
