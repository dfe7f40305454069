"""Decode steps replayed as CUDA graphs: the paged fast path on CUDA (engine/model/fast_llama.py).

A decode step launches a few hundred small kernels (norms, products, RoPE, the attention kernel of each layer)
whose launch costs more than their work at small batches. A step of decode rows alone (no prompt chunk, every
row's logits kept) is padded to the next *capture size* (1, 2, 4, 8, then multiples of 8 up to the batch limit,
as vLLM does) and replayed from a graph captured for that size (at the warm-up): one launch for the forward.

A graph reads its inputs from fixed addresses: two int64 device buffers (for the largest size) hold the token
ids, positions, attention tile counts, RoPE shifts (`StepInputs.rope_shifts`: M-RoPE's text) and KV write index,
and the block tables (each row's padded to the longest a context can need), written into pinned host copies and
copied over before the replay; a row that holds the same sequence's table as the step before gets only its new
blocks written. Padding rows (token 0 at position 0) write into a block no sequence holds, skip their attention
(tile count 0), and their logits are dropped. The Triton backend's metadata is made from the graphs' own buffers
(`TritonBackend.graph_plan`) and its kernel loops on device data: one graph serves every context length.

Sampling is in the graph too: each graph computes every row's greedy token and logprob (`sampling.greedy_pick`),
or a sampled graph (`sample`, runner/graph_sampling.py, of `graph_sampling.kind`) samples and penalizes the
rows from their parameters' buffers and the runner's `PenaltyBook` (`penalties_ran`). The runner takes the
pick, with the rows' top-N, as the step's one transfer (`send_pick`); a row the graph cannot sample (a logit
bias, a grammar's mask) is sampled from the logits alone. Every graph writes its logits and pick into the
same two buffers (outside the graphs' pool), valid until the next replay: the pool keeps the largest
graph's intermediates, not each graph's outputs (0.56 GB of logits a kind at 128 rows of a 128k vocabulary).

With LoRA adapters configured (`carry_lora`, before the first capture), every graph also computes the
products of `max_loras` fixed adapter slots (engine/lora/slots.py), each row's slot one more input buffer;
a step with more adapters than slots runs eagerly. `enforce_eager` (vLLM's and LMI's option) turns graphs
off; a capture that fails is logged and the engine goes on eagerly. A tensor-parallel rank's graphs hold its shard's
collectives. Not with experts outside bfloat16 (`experts_graph_reason`). On a CPU (``capture=False``, the tests)
`run` computes the same padded step from the same buffers without capturing, watched for what a capture cannot hold.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention import triton_ops as triton_attention
from lmiserve.engine.attention.backends import TritonBackend
from lmiserve.engine.attention.paged import PagedKVCache
from lmiserve.engine.lora.slots import LoraSlots
from lmiserve.engine.runner import graph_sampling, seeded_draw
from lmiserve.engine.runner.graph_sampling import GraphRow, GraphSampler
from lmiserve.engine.runner.in_flight import PickTransfers
from lmiserve.engine.runner.sampling import greedy_pick

if TYPE_CHECKING:
    from lmiserve.engine.lora.batch import LoraBatch
    from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
    from lmiserve.engine.runner.penalties import PenaltyBook

__all__ = ["MAX_CAPTURE_SIZE", "DecodeGraphs", "capture_sizes", "for_model", "of_runner", "wanted"]

log = logging.getLogger(__name__)

# the largest decode batch captured (larger steps run eagerly; vLLM's default is 512)
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first size that holds `max_rows` (at most `MAX_CAPTURE_SIZE`)."""
    limit = min(max(1, max_rows), MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]
    return [s for s in sizes if s < limit] + [next(s for s in sizes if s >= limit)]


PARTS = 5  # the packed buffer's parts of a row each (`_parts`: ids, positions, tile counts, sources, shifts)
GREEDY = "greedy"  # a graph's kind (`DecodeGraphs._graphs`' keys): its rows' greedy pick, else graph_sampling.kind


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # views of the graphs' output buffers
    pick: torch.Tensor  # `greedy_pick` of the logits (a sampled graph: `GraphSampler.pick`'s)


class DecodeGraphs:
    """The captured decode graphs of one `FastLlama` (over a paged cache, Triton attention)."""

    def __init__(
        self,
        fast: FastLlama,
        max_rows: int,
        scratch_block: int,
        capture: bool | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        """`scratch_block`: a block of the cache no sequence holds, where padding rows write; `prompt_tokens`:
        a step's prompt chunks of up to this many tokens join its decode rows as rows of the graph
        (`folds`), so the sizes go up to `max_rows` plus it."""
        if not fast.triton:
            raise ValueError("decode graphs need the Triton attention")
        self.fast = fast
        self.prompt_tokens = max(0, prompt_tokens)
        self.sizes = capture_sizes(max_rows + self.prompt_tokens)
        self.capture = fast.device.type == "cuda" if capture is None else capture
        cache = fast.cache
        if not isinstance(cache, PagedKVCache):
            raise ValueError("decode graphs need a paged KV cache")
        self.cache = cache
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the pool's {cache.num_blocks} blocks")
        self.scratch_block = scratch_block
        self.block_size = cache.block_size
        self.kv_heads = fast.kv_heads
        self.width = -(-fast.max_context // self.block_size)
        largest = self.sizes[-1]
        # (host, device) pairs: ids, positions, tile counts, sources, shifts, write index [largest * kv_heads]; tables
        packed, tables = (PARTS * largest + largest * self.kv_heads,), (largest, self.width)
        self._host = [torch.zeros(shape, dtype=torch.int64, pin_memory=self.capture) for shape in (packed, tables)]
        self._device = [torch.zeros(shape, dtype=torch.int64, device=fast.device) for shape in (packed, tables)]
        self._rows = torch.arange(largest, dtype=torch.int64, device=fast.device)
        self._host_parts = [t.numpy() for t in self._parts(self._host[0])]  # ids, positions, ..., write
        self._host_tables = self._host[1].numpy()
        self._sent: torch.cuda.Event | None = None  # the last step's inputs copied: the host buffers are free
        # each graph's picked tokens, where the next step's chained rows read their inputs (`run`'s sources)
        self._last_tokens = torch.zeros(largest, dtype=torch.int64, device=fast.device)
        # the picks' transfers to the host (with top-N: graph_sampling.with_top_n's columns)
        self._picks = PickTransfers(largest * (3 + 2 * graph_sampling.GRAPH_TOP_N), self.capture)
        # every graph's outputs (outside the graphs' pool): the logits, and the pick ([rows, 2 or 3], packed)
        self._logits_out = torch.empty((largest, fast.logits_width), dtype=torch.float32, device=fast.device)
        self._pick_out = torch.empty(largest * 3, dtype=torch.float64, device=fast.device)
        self.sampler: GraphSampler | None = None  # the sampled rows' parameters (`sample`), made when first wanted
        self._sampling: tuple[Sequence[GraphRow], PenaltyBook | None] | None = None  # the next `run`'s (`sample`)
        self.penalties_ran = False  # the last `run` penalized its rows in the book (marked their input tokens)
        self.sampler_failed = False  # a sampled graph failed to capture: sampled steps sample eagerly
        # each host table row's list written from (None: padding), how many of its blocks, its largest block id
        self._held: list[Sequence[int] | None] = [None] * largest
        self._written = np.zeros(largest, dtype=np.int64)
        self._largest_block = np.zeros(largest, dtype=np.int64)
        self._last: tuple[torch.Tensor, torch.Tensor, bool] | None = None  # the last step's (logits, pick, sampled)
        self._graphs: dict[tuple[int, str], _Captured] = {}  # by size and kind
        self._pool: Any = None  # the graphs' shared memory pool (torch's handle)
        self.failed = False
        self.lora: LoraSlots | None = None  # the adapters' slots every graph computes (`carry_lora`)
        fast.rope_upto(fast.max_context)

    def carry_lora(self, slots: int, rank: int) -> None:
        """Every graph computes `slots` LoRA adapters' products (lora/slots.py), of rank <= `rank`; before capturing."""
        if self._graphs:
            raise RuntimeError("LoRA slots must be given to the decode graphs before the first capture")
        self.lora = LoraSlots(self.fast.lora_groups(), slots, rank, self.sizes[-1], self.fast.device, self.fast.dtype)

    @property
    def samples(self) -> bool:
        """Whether steps of sampled rows may replay sampled graphs (`sample`)."""
        return graph_sampling.USE_IN_GRAPHS and not self.sampler_failed and seeded_draw.usable(self.fast.device)

    def sample(self, rows: Sequence[GraphRow], book: PenaltyBook | None = None) -> bool:
        """The next `run`'s rows (``(params, seed, token index, book slot)`` each, all `graph_sampling.in_graph`)
        sample inside its graph; False where they cannot (`samples`): the runner samples them from the logits."""
        if not self.samples:
            return False
        if self.sampler is None:
            self.sampler = GraphSampler(self.sizes[-1], self.fast.logits_width, self.fast.device, self.capture)
        self._sampling = rows, book  # written with the step's other inputs (`_fill`)
        return True

    def covers(self, rows: int, lora: LoraBatch | None = None) -> bool:
        if lora is not None and (self.lora is None or len(lora.adapters) > self.lora.slots):
            return False
        return not self.failed and 0 < rows <= self.sizes[-1]

    def folds(self, decode_rows: int, chunks: Sequence[tuple[Any, int, Sequence[int]]], lora: Any = None) -> bool:
        """Whether a step of `decode_rows` decode rows and prompt `chunks` (``(table, start, tokens)``) replays a
        graph, a chunk token a row (`run_folded`): at most `prompt_tokens` of them, no adapters, within the sizes."""
        tokens = sum(len(chunk) for _, _, chunk in chunks)
        return 0 < tokens <= self.prompt_tokens and lora is None and self.covers(decode_rows + tokens)

    def run_folded(self, step: StepInputs) -> torch.Tensor | None:
        """The logits of `step`'s kept rows (`StepInputs.keep`) where `folds` takes its prompt chunks, each chunk
        token a row at its position, through its sequence's table: every key and value is written before any
        row attends over its positions up to its own (a chunk's causal attention). None otherwise (eager)."""
        if not self.folds(len(step.decode_ids), step.chunks, step.lora):
            return None
        ids, positions = step.tokens()
        tables: list[Sequence[int]] = [*step.decode_tables, *(table for table, _, chunk in step.chunks for _ in chunk)]
        logits = self.run(ids, positions, tables, shifts=step.token_shifts())
        if step.keep == list(range(len(ids))):
            return logits
        return logits.index_select(0, host_copy.to_device(step.keep, self.fast.device))

    def capture_all(self) -> list[int]:
        """Capture every size not captured yet (the warm-up's last part, engine/core/warmup.py: sizes past the
        batch limit only prompt rows reach) from padding rows; the sizes captured (none on a CPU, or once failed)."""
        done: list[int] = []
        if not self.capture or self.failed:
            return done
        for size in self.sizes:
            if (size, GREEDY) in self._graphs:
                continue
            # one row on the scratch block (token 0 at position 0, as a padding row), the rest padding
            self._fill([0], [0], [[self.scratch_block]], size)  # (and the base model's LoRA slots)
            try:
                self._capture(size)
            except Exception:  # noqa: BLE001 - as in `run`: a capture problem costs speed, not serving
                log.exception("capturing a CUDA graph of %d rows failed; decode steps run eagerly", size)
                self.failed = True
                break
            done.append(size)
        return done

    def size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def _parts(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The ids, positions, tile counts, sources, shifts and write index in a packed buffer (host or device)."""
        largest = self.sizes[-1]
        return [*(packed[i * largest : (i + 1) * largest] for i in range(PARTS)), packed[PARTS * largest :]]

    def _fill_tables(self, tables: Sequence[Sequence[int]], size: int) -> int:
        """The step's block tables into the host tables, row by row only past what the row already holds
        of the same list; the padding rows read the scratch block. Returns the widest table's length."""
        host = self._host_tables
        held, written, largest = self._held, self._written, self._largest_block
        width = 0
        for row, table in enumerate(tables):
            length, start = len(table), int(written[row])
            if held[row] is not table or length < start:  # another sequence's table (or one replaced)
                held[row], start, written[row], largest[row] = table, 0, 0, -1
            if length > start:
                new = table[start:]
                host[row, start:length] = new
                largest[row] = max(int(largest[row]), max(new))
                written[row] = length
            width = max(width, length)
        rows = len(tables)
        held[rows:size] = [None] * (size - rows)
        host[rows:size, 0] = self.scratch_block
        return width

    def _fill(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        size: int,
        sources: Sequence[int] | None = None,
        sampling: tuple[Sequence[GraphRow], PenaltyBook | None] | None = None,
        lora: LoraBatch | None = None,
        shifts: Sequence[int] | None = None,
    ) -> None:
        """The step's rows, padded to `size` (token 0 at position 0 of the scratch block), into the host buffers,
        then copied over: the packed part a graph of `size` rows reads, the tables as wide as the step's longest,
        the rows' `sampling` (`sample`) and LoRA slots (`lora`); once the last step's copies are done (a chained
        step comes before: every host buffer it copies from, the slots' too, is free only then)."""
        if self._sent is not None:
            self._sent.synchronize()
        rows = len(ids)
        host_ids, host_pos, host_counts, host_sources, host_shifts, host_write = self._host_parts
        host_sources[:size], host_shifts[:size] = -1, 0
        if sources is not None:
            host_sources[:rows] = sources
        host_shifts[:rows] = 0 if shifts is None else shifts
        host_ids[:rows] = ids
        host_ids[rows:size] = 0
        host_pos[:rows] = positions
        host_pos[rows:size] = 0
        host_counts[:rows] = 1
        host_counts[rows:size] = 0
        width = self._fill_tables(tables, size)
        pos = host_pos[:size]
        block = self._host_tables[np.arange(size), pos // self.block_size]
        host_write[: size * self.kv_heads] = triton_attention.token_rows(block, pos, self.kv_heads, self.block_size)
        self.cache.ensure_zeroed(1 + int(self._largest_block[:rows].max()))
        packed = PARTS * self.sizes[-1] + size * self.kv_heads
        self._device[0][:packed].copy_(self._host[0][:packed], non_blocking=self.capture)
        self._device[1][:size, :width].copy_(self._host[1][:size, :width], non_blocking=self.capture)
        if sampling is not None and self.sampler is not None:
            self.sampler.fill(sampling[0], size, sampling[1])
        if self.lora is not None:
            self.lora.set_step(lora, rows, size)
        if self.fast.device.type == "cuda":
            self._sent = self._sent or torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._sent.record()

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, triton_attention.StepTiles, LoraSlots | None]:
        """The fixed-address views a graph of `size` rows reads (a chained row's token id from the last graph's
        greedy tokens; the positions RoPE rotates), the attention backend's metadata made from them, the slots."""
        ids, positions, counts, sources, shifts, write = self._parts(self._device[0])
        ids, sources = ids[:size], sources[:size]
        ids = torch.where(sources >= 0, self._last_tokens[sources.clamp(min=0)], ids)
        tables = self._device[1]
        attention = self.fast.attention
        assert isinstance(attention, TritonBackend)
        meta = attention.graph_plan(
            self._rows[:size], counts[:size], positions[:size], tables[:size], write[: size * self.kv_heads]
        )
        return ids, positions[:size] + shifts[:size], meta, self.lora

    def run(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        lora: LoraBatch | None = None,
        sources: Sequence[int] | None = None,
        shifts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab]`` of a step of decode rows, with the adapters of `lora` (its
        token rows: these rows; only where `covers` says so); `sources`: each row's row in the last step
        whose greedy token is its input, on the device (-1: `ids`'); `shifts`: each row's RoPE shift (None:
        none). The logits are the graph's output, valid until the next step; `send_pick` sends their pick."""
        rows = len(ids)
        size = self.size_for(rows)
        sampling, self._sampling = self._sampling, None
        kind = GREEDY if sampling is None else graph_sampling.kind(row[0] for row in sampling[0])
        if sampling is not None and sampling[1] is not None and self.sampler and self.sampler.moved(kind, sampling[1]):
            self._graphs = {key: graph for key, graph in self._graphs.items() if not graph_sampling.stages(key[1])[1]}
        self._fill(ids, positions, tables, size, sources, sampling, lora, shifts)
        captured = self._graphs.get((size, kind))
        if captured is None and self.capture and not self.failed:
            try:
                captured = self._capture(size, kind)
            except Exception:  # noqa: BLE001 - a capture problem costs speed, not the step: run eagerly
                log.exception("capturing a CUDA graph of %d decode rows (%s) failed; they run eagerly", size, kind)
                self.sampler_failed = self.sampler_failed or kind != GREEDY
                self.failed = self.failed or kind == GREEDY
                kind = GREEDY
        if captured is None:  # on a CPU (the tests), or the capture failed: the same step, not captured
            logits, pick = self._step(size, kind)
        else:
            captured.graph.replay()
            logits, pick = captured.logits, captured.pick
        self._last = (logits[:rows], pick[:rows], kind != GREEDY)
        self.penalties_ran = graph_sampling.stages(kind)[1]
        return self._last[0]

    def send_pick(
        self, logits: torch.Tensor, sampled: bool = False, top_n: int = 0
    ) -> Callable[[], list[list[float]]] | None:
        """When `logits` are the last step's output, its pick greedy (`sampling.greedy_pick`) or, `sampled`, a
        sampled graph's (`GraphSampler.pick`), with each row's `top_n` likeliest tokens (`with_top_n`): start its
        transfer; the call that waits for it and gives its rows (``[[token, logprob(, undrawable)], ...]``)."""
        if self._last is None or self._last[0] is not logits or self._last[2] != sampled:
            return None
        pick = self._last[1]
        return self._picks.send(graph_sampling.with_top_n(pick, logits, top_n) if top_n else pick)

    def _step(self, size: int, kind: str = GREEDY) -> tuple[torch.Tensor, torch.Tensor]:
        """A graph of `size` rows and `kind`: its logits and pick in the output buffers (chained rows read it)."""
        logits, (ids, positions, meta, lora) = self._logits_out[:size], self._inputs(size)
        self.fast.decode_body(ids, positions, meta, lora, out=logits)
        filtered, penalized = graph_sampling.stages(kind)
        sampler = self.sampler if kind != GREEDY else None
        pick = greedy_pick(logits) if sampler is None else sampler.pick(logits, filtered, ids if penalized else None)
        out = self._pick_out[: pick.numel()].view(pick.shape)
        out.copy_(pick)
        self._last_tokens[:size].copy_(pick[:, 0])
        return logits, out

    def _capture(self, size: int, kind: str = GREEDY) -> _Captured:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels: `_warm_up`), then capture, into
        the memory pool the graphs share (which records the step without running it)."""
        stream = torch.cuda.Stream(device=self.fast.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.fast.device))
        with torch.cuda.stream(stream):
            self._warm_up(size, kind)
        torch.cuda.current_stream(self.fast.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's thread on this GPU may use CUDA meanwhile without breaking the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, pick = self._step(size, kind)
        self._pool = graph.pool()
        captured = self._graphs[size, kind] = _Captured(graph, logits, pick)
        log.info("captured a CUDA graph of %d decode rows (%s)", size, kind)
        return captured

    def _warm_up(self, size: int, kind: str) -> None:
        """The step computed once from its buffers, then what the replay that follows reads put back: the last
        greedy tokens (a chained row's input) and a penalized pick's marks in the book (`GraphSampler.kept`)."""
        last_tokens, penalizes = self._last_tokens.clone(), self.sampler if graph_sampling.stages(kind)[1] else None
        with penalizes.kept(self._inputs(size)[0]) if penalizes is not None else contextlib.nullcontext():
            self._step(size, kind)
        self._last_tokens.copy_(last_tokens)


def of_runner(runner: object) -> DecodeGraphs | None:
    """The decode graphs a runner replays (its fast forward's), None for a runner without them."""
    return getattr(getattr(runner, "fast", None), "graphs", None)


def wanted(device: torch.device, enforce_eager: bool) -> bool:
    """Whether a paged fast runner on `device` may capture decode graphs (with a scratch block; `for_model`)."""
    return device.type == "cuda" and not enforce_eager


def for_model(fast: FastLlama, max_rows: int, scratch_block: int, prompt_tokens: int = 0) -> DecodeGraphs | None:
    """The decode graphs for `fast` (`wanted`) where they apply (the Triton kernel, `graph_refusal`); a tensor-parallel
    rank's hold its collectives (every rank the same sizes; a capture communicates nothing: docs/engine.md)."""
    why = "they need the Triton paged attention" if not fast.triton else fast.graph_refusal  # (experts outside bf16)
    if why is not None:
        log.info("CUDA graphs: off (%s)", why)
        return None
    return DecodeGraphs(fast, max_rows, scratch_block, prompt_tokens=prompt_tokens)
