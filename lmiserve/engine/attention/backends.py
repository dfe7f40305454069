"""Attention backends: how a step's attention runs over the paged KV cache, one interface for every kernel.

A backend builds its per-step metadata once (`plan`, from the step's sequences: each one's block table,
first position and token count, decode rows first) and then runs every layer with it (`forward(layer, q,
k, v, meta)`: it stores the step's keys and values through the block tables and returns each token's
attention over its own sequence's positions up to its own, within the layer's sliding window). Both model
forwards run through a backend: lmiserve's own (engine/model/fast_llama.py) and transformers' model on the
generic runner (runner/generic.py registers `backend_attention` as an attention implementation).

- `TritonBackend` (CUDA): every token of the step, decode rows and prompt chunks alike, in one Triton
  kernel launch a layer (attention/triton_ops.py), reading the blocks in place. Its metadata can also be
  made from fixed device buffers (`graph_plan`), which the captured CUDA graphs own (attention/cuda_graphs.py).
- `CpuKernelBackend` (CPU, an fp32 or bf16 cache, numba): the decode rows and the step's leading short prompt
  chunks (drafts being verified, short chunks; one row a token) in one compiled kernel call a layer
  (attention/cpu_kernel.py); a longer chunk gathers its positions and runs SDPA.
- `TorchBackend` (any device and dtype): the decode rows gather their blocks and attend with batched matmuls
  (masked fp32 softmax), each chunk gathers its positions and runs SDPA (soft-capped scores: torch ops).
`choose` picks one for a model's attention shape on its device; a new kernel is a new backend here.

An fp8 pool (`kv_cache_dtype`, attention/kv_quant.py): every backend quantizes what it writes and
dequantizes what it reads with the layer's scales (`cache.scales`). Triton loads the fp8 blocks and casts
them in the kernel (checked on an H200; its self-check runs in fp8 first and keeps the torch path if it
disagrees); the compiled CPU kernel widens each byte by its bits, with the scales applied to the scores and the
output.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention import cpu_kernel, cpu_kernel_loops, kv_quant, triton_ops, windows
from lmiserve.engine.attention.backend_base import AttentionBackend, KvStore, SeqTokens
from lmiserve.engine.attention.paged import (
    DecodeIndex,
    PagedKVCache,
    decode_index,
    flat_index,
    gather_context,
    torch_decode_attention,
    write_chunk,
)
from lmiserve.engine.attention.scores import chunk_attention

__all__ = [
    "KERNEL_CHUNK_TOKENS",
    "AttentionBackend",
    "CpuKernelBackend",
    "SeqTokens",
    "TorchBackend",
    "TritonBackend",
    "choose",
]

log = logging.getLogger(__name__)

# a prefill chunk of at most this many tokens attends through the compiled decode kernel on CPU fp32
# (measured on SmolLM2's attention shape, 2 AMD EPYC cores: 28 tokens after 1,972 take 5.3 ms a layer
# there against 8.9 ms gathered with SDPA; from 64 tokens SDPA wins)
KERNEL_CHUNK_TOKENS = 32
# the step's leading chunks of at most KERNEL_CHUNK_TOKENS tokens join the decode rows in one kernel call a
# layer, their keys and values written through an index made once a step (a 2-token chunk at position 200
# of SmolLM2-135M: attention 10.5 -> 4.6 ms a step on the AMD EPYC); False: a kernel call, a write and its
# index a chunk and a layer (benchmarks/verify_chunk.py's "before")
CHUNKS_AS_DECODE_ROWS = True
# the most decode rows whose attention output the Triton kernel also writes in fp8 (`attend_stored`'s `fp8_rows`)
ROWS_IN_FP8 = 64


# ---- Triton (CUDA) ---------------------------------------------------------------------------------------


class TritonBackend(AttentionBackend):
    name = "triton"
    _done: torch.Tensor | None = None  # the kernel's count a row of `attend_stored`'s rows in fp8 (zeros between)

    def plan(self, seqs: Sequence[SeqTokens], decode_rows: int, pad: int) -> triton_ops.StepTiles:
        self._ensure(seqs)
        sequences = [(s.table, s.start, s.count) for s in seqs]
        return triton_ops.step_tiles(sequences, self.groups, self.kv_heads, self.cache.block_size, self.cache.device)

    def graph_plan(
        self,
        rows: torch.Tensor,
        counts: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        write: torch.Tensor,
    ) -> triton_ops.StepTiles:
        """The metadata of a step of ``len(rows)`` decode rows read from fixed device buffers (a captured
        CUDA graph's, which its owner fills before each replay): each row its own tile (`rows`: 0..n-1),
        its token count (0 for a padding row: the kernel writes its zeros), position, block table and KV write
        index."""
        size = len(rows)
        block_q = triton_ops.tile_tokens(self.groups, 1)
        return triton_ops.StepTiles(rows, rows, counts, positions, tables, write, block_q, size, size, rows_tiled=True)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: triton_ops.StepTiles,
        scale: float | None = None,
    ) -> torch.Tensor:
        n, cache = meta.tokens, self.cache  # padding rows: in no tile, left zero
        triton_ops.write_step(cache.keys[layer], cache.values[layer], k[:n], v[:n], meta, cache.scales[layer])
        return self.attend_stored(layer, q, meta, scale)

    def store_target(self, layer: int, meta: triton_ops.StepTiles) -> KvStore:
        dim = self.head_dim
        keys, values = self.cache.keys[layer].view(-1, dim), self.cache.values[layer].view(-1, dim)
        return KvStore(keys, values, meta.write, self.cache.scales[layer], meta.tokens)

    def attend_stored(
        self,
        layer: int,
        q: torch.Tensor,
        meta: triton_ops.StepTiles,
        scale: float | None = None,
        fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        keys, values, scales = self.cache.keys[layer], self.cache.values[layer], self.cache.scales[layer]
        scale = self.scale if scale is None else scale
        window, cap = self.windows[layer], self.softcap
        rows = None
        if fp8_rows is not None:
            if not self.writes_fp8_rows(meta):
                raise ValueError("the output's rows in fp8 are written for a decode graph's plan of at most 64 rows")
            if self._done is None:  # (made in a graph's eager warm-up, before its capture)
                self._done = torch.zeros(ROWS_IN_FP8, dtype=torch.int32, device=q.device)
            rows = (*fp8_rows, self._done)
        out = triton_ops.paged_attention(
            q, keys, values, meta, scale, window=window, kv_scales=scales, softcap=cap, sinks=self.sink(layer),
            fp8_rows=rows,
        )  # fmt: skip
        return out.reshape(len(q), -1)

    def writes_fp8_rows(self, meta: triton_ops.StepTiles) -> bool:
        return meta.rows_tiled and meta.tiles <= ROWS_IN_FP8


# ---- torch ops and the compiled CPU kernel -----------------------------------------------------------------


class _Chunk(NamedTuple):
    """A prefill chunk of one step: its block table (a tensor), positions ``start..end-1``, first row in
    the batch and causal mask over ``[0, end)`` (and that of the model's sliding-window layers), opened where
    the chunk's `SeqTokens.opens` say (`opened`: then it never runs the compiled kernel, which is causal)."""

    table: torch.Tensor
    start: int
    end: int
    offset: int
    mask: torch.Tensor
    window_mask: torch.Tensor | None = None
    opened: bool = False


class _Decode(NamedTuple):
    """The decode rows of a step: their block tables (``[rows, blocks]``, padded with block 0 past each
    row's own), spans (position + 1) and what every layer shares: for the compiled kernel its host arguments
    (`kernel`), else the torch attention's indexes. With the compiled kernel the step's leading short
    prefill chunks join as rows, one a token (`rows` counts them too); `write`, then, is where every row's
    key and value go in a ``[-1, head_dim]`` view of a layer's cache (written before the kernel runs, so
    that no token reads a position of its chunk before it is written)."""

    rows: int
    tables: torch.Tensor
    spans: npt.NDArray[np.int64]
    shared: DecodeIndex | None
    kernel: cpu_kernel.KernelRows | None = None
    write: torch.Tensor | None = None


class _BlockStep(NamedTuple):
    decode: _Decode | None
    chunks: list[_Chunk]
    pad: int


class TorchBackend(AttentionBackend):
    """The decode rows through torch ops over their gathered blocks, each chunk with SDPA."""

    name = "torch"
    compiled = False  # the CPU kernel's rows and chunks

    def plan(self, seqs: Sequence[SeqTokens], decode_rows: int, pad: int) -> _BlockStep:
        self._ensure(seqs)
        dev = self.cache.device
        positions = [s.start for s in seqs[:decode_rows]]
        tables = [list(s.table) for s in seqs[:decode_rows]]
        chunks = list(seqs[decode_rows:])
        short = 0
        if self.compiled and CHUNKS_AS_DECODE_ROWS:  # the leading short chunks: rows of the decode kernel
            for seq in chunks:
                if seq.count > KERNEL_CHUNK_TOKENS or seq.opens:
                    break
                positions.extend(range(seq.start, seq.start + seq.count))
                tables.extend([list(seq.table)] * seq.count)
                short += 1
        decode = self._decode(positions, tables, decode_rows) if positions else None
        offset = len(positions)
        planned = []
        for seq in chunks[short:]:
            end = seq.start + seq.count
            chunk_pos = torch.arange(seq.start, end, device=dev)
            masks = windows.chunk_masks(chunk_pos, end, self.windows)
            for first, last in seq.opens:  # (as transformers: each layer kind's mask OR the image's block)
                for mask in (m for m in masks if m is not None):
                    mask[..., first - seq.start : last - seq.start, first:last] = True
            table = host_copy.to_device(list(seq.table), dev)
            planned.append(_Chunk(table, seq.start, end, offset, *masks, bool(seq.opens)))
            offset += seq.count
        return _BlockStep(decode, planned, pad)

    def _decode(self, positions: list[int], tables: list[list[int]], decode_rows: int) -> _Decode:
        """`positions`/`tables`: the decode rows', then (compiled kernel only) those of the short chunks'
        tokens after the first `decode_rows`."""
        device, block_size = self.cache.device, self.cache.block_size
        spans = np.array(positions, dtype=np.int64) + 1
        width = max(-(-int(span) // block_size) for span in spans)
        padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
        table = host_copy.to_device(padded, device)
        if self.compiled:
            write = None
            if len(positions) > decode_rows:
                pos = host_copy.to_device(spans - 1, device)
                rows = torch.arange(len(positions), device=device)
                write = flat_index(table[rows, pos // block_size], pos % block_size, self.kv_heads, block_size)
                write = write.reshape(-1)
            kernel = cpu_kernel.KernelRows.of(table, spans, self.kv_heads)
            return _Decode(len(positions), table, spans, None, kernel, write)
        return _Decode(len(positions), table, spans, decode_index(table, spans, block_size, device))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: _BlockStep,
        scale: float | None = None,
    ) -> torch.Tensor:
        """The decode rows in one call that writes and attends through their block tables, each prefill
        chunk written into its blocks and attending over its positions: a short chunk (at most
        `KERNEL_CHUNK_TOKENS` tokens, the compiled kernel) through the same kernel, each of its tokens a row
        that reads the blocks in place up to its own position; a longer one over its positions gathered
        from the blocks, with SDPA; a sliding-window layer's window in each."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        # (a soft cap or sinks: never the compiled kernel, which has neither)
        window, cap, sinks = self.windows[layer], self.softcap, self.sink(layer)
        scale = self.scale if scale is None else scale
        scales = self.cache.scales[layer]  # an fp8 pool's (1.0 for any other)
        outputs = []
        dec = meta.decode
        if dec is not None:
            n = dec.rows
            query = q[:n].reshape(n, self.kv_heads, self.groups, self.head_dim)
            if dec.kernel is not None:
                if dec.write is not None:  # chunks' tokens among the rows: every key and value written first
                    dim = self.head_dim
                    kv_quant.store(keys.view(-1, dim), dec.write, k[:n].reshape(-1, dim), scales[0])  # (as the pool)
                    kv_quant.store(values.view(-1, dim), dec.write, v[:n].reshape(-1, dim), scales[1])
                rows = dec.kernel
                out = cpu_kernel.kernel_decode_attention(query, keys, values, k[:n], v[:n], rows, scale, window, scales)
            else:
                out = torch_decode_attention(  # (torch's even where the kernel applies: the autotune's rival)
                    query,
                    keys,
                    values,
                    k[:n],
                    v[:n],
                    dec.tables,
                    dec.spans,
                    scale,
                    dec.shared,
                    window,
                    scales,
                    cap,
                    sinks,
                )
            outputs.append(out.reshape(n, -1))
        for table, start, end, offset, mask, window_mask, opened in meta.chunks:
            length = end - start
            write_chunk(keys, values, k[offset : offset + length], v[offset : offset + length], table, start, scales)
            if self.compiled and length <= KERNEL_CHUNK_TOKENS and not opened:
                # the chunk is written: each token attends over positions up to its own (it writes its
                # own key and value again, the same numbers, so no row reads a position not yet written)
                query = q[offset : offset + length].reshape(length, self.kv_heads, self.groups, self.head_dim)
                out = cpu_kernel.compiled_decode_attention(
                    query,
                    keys,
                    values,
                    k[offset : offset + length],
                    v[offset : offset + length],
                    table[None].expand(length, -1),
                    np.arange(start + 1, end + 1, dtype=np.int64),
                    scale,
                    window=window,
                    scales=scales,
                )
                outputs.append(out.reshape(length, -1))
                continue
            context_k, context_v = gather_context(keys, values, table, end, q.dtype, scales)
            query = q[offset : offset + length].transpose(0, 1)[None]
            key = _repeat(context_k[None], self.groups)
            value = _repeat(context_v[None], self.groups)
            seen = mask if window is None else window_mask
            out = chunk_attention(query, key, value, seen, scale, cap, sinks)
            outputs.append(out.transpose(1, 2).reshape(length, -1))
        if meta.pad:
            outputs.append(q.new_zeros(meta.pad, self.heads * self.head_dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


class CpuKernelBackend(TorchBackend):
    """The decode rows and the leading short chunks through the compiled CPU kernel (an fp32 or bf16 cache, numba)."""

    name = "cpu_kernel"
    compiled = True

    def __init__(self, cache: PagedKVCache, heads: int, layer_windows: Sequence[int | None]) -> None:
        if not cpu_kernel.available(cache.kv_dtype, cache.device):
            raise ValueError(f"the compiled CPU attention reads fp32, bf16 and fp8 CPU caches, not {cache.kv_dtype}")
        cpu_kernel.warm_up(cache.kv_dtype)  # compiled (or loaded from numba's cache) for this cache's dtype
        super().__init__(cache, heads, layer_windows)

    def decode_kernel(self, meta: _BlockStep) -> Callable[[int, Any, Any, Any, Any], None] | None:
        """For a step of decode rows alone through the kernel's one-task-a-kv-head form: a call
        ``(layer, query, new_keys, new_values, out)`` on C-contiguous fp32 numpy arrays (``[rows, kv_heads,
        groups, dim]``, ``[rows, kv_heads, dim]`` twice, `out` as `query`) that does what `forward` does
        without its per-call tensors and views (engine/model/q4_decode.py), over any pool the kernel reads (fp32,
        bf16, fp8); None for any other step."""
        dec = meta.decode
        if dec is None or dec.kernel is None or dec.write is not None or meta.chunks or meta.pad:
            return None
        rows = dec.kernel
        if rows.parts != self.kv_heads:
            return None
        kernel, keys, values, windows = (
            cpu_kernel_loops.compiled_head_kernel(),
            self.cache.keys,
            self.cache.values,
            [window or 0 for window in self.windows],
        )
        tables, spans, kv_dtype, layer_scales = rows.tables, rows.spans, self.cache.kv_dtype, self.cache.scales
        fp8 = kv_quant.is_fp8(kv_dtype)  # an fp8 pool's key scale in the scores' scale, its value scale on the output
        scales = [np.float32(self.scale * (key if fp8 else 1.0)) for key, _ in layer_scales]

        def call(layer: int, query: Any, new_keys: Any, new_values: Any, out: Any) -> None:
            if kv_dtype != torch.float32:  # the new keys and values as a bf16 or fp8 pool stores them
                key_scale, value_scale = layer_scales[layer]
                new_keys = cpu_kernel.stored_bits(torch.from_numpy(new_keys), kv_dtype, key_scale)
                new_values = cpu_kernel.stored_bits(torch.from_numpy(new_values), kv_dtype, value_scale)
            cached = cpu_kernel.bits(keys[layer]), cpu_kernel.bits(values[layer])
            kernel(query, *cached, new_keys, new_values, tables, spans, scales[layer], windows[layer], out)
            if fp8 and layer_scales[layer][1] != 1.0:
                out *= np.float32(layer_scales[layer][1])

        return call


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, heads, length, dim = x.shape
    return x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length, dim)


# ---- the choice -----------------------------------------------------------------------------------------


def choose(
    cache: PagedKVCache, heads: int, layer_windows: Sequence[int | None], *, compiled_ok: bool = True
) -> AttentionBackend:
    """The backend for a model's attention shape over `cache`: Triton where `triton_ops.chosen` (CUDA, or as the
    option says) and its self-check agrees for this shape, else the compiled CPU kernel where it applies (an
    fp32, bf16 or fp8 cache on CPU, numba; `compiled_ok`: not ruled out by the kernel autotune), else torch ops."""
    if triton_ops.chosen(cache.device):
        kv_dtype = cache.kv_dtype if cache.kv_dtype != cache.dtype else None
        shape = (cache.kv_heads, heads // cache.kv_heads, cache.head_dim, cache.block_size)
        why = triton_ops.self_check(*shape, cache.dtype, str(cache.device), kv_dtype)
        if why is None:
            return TritonBackend(cache, heads, layer_windows)
        log.warning("the Triton paged attention kernel is not used (%s); gathering blocks instead", why)
    if compiled_ok and cpu_kernel.available(cache.kv_dtype, cache.device):
        try:  # compiles (or loads from numba's cache) at load, not on a request
            return CpuKernelBackend(cache, heads, layer_windows)
        except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the model
            log.exception("compiled CPU attention unavailable; using torch ops")
    return TorchBackend(cache, heads, layer_windows)
