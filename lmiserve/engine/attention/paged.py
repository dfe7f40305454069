"""Attention over a block (paged) KV cache: the storage and the reads/writes the model needs.

The KV memory is one pool of ``num_blocks`` blocks of ``block_size`` token slots (the allocator is
`kv_blocks.BlockPool`). Per layer, keys and values are each one tensor ``[num_blocks, kv_heads,
block_size, head_dim]``: a block's tokens of one head are contiguous (``block_size * head_dim`` values),
so a read walks each row's blocks in order.
The token at position ``p`` of a sequence lives at offset ``p % block_size`` of block
``block_table[p // block_size]``.

Decode (`paged_decode_attention`): each row writes its new key/value at position ``spans[r] - 1`` and
its query heads (GQA packed per kv head, ``[rows, kv_heads, groups, head_dim]``) attend over positions
``0..spans[r]-1`` through its block table. Two implementations with that contract: the compiled numba
kernel for an fp32, bf16 or fp8 cache on CPU (attention/cpu_kernel.py; `cpu_kernel.available` says when it
applies) and torch ops for every other dtype and device (a flat `index_copy_` write, a gather of the rows'
blocks, a masked fp32 softmax).

A `window` (a sliding-window layer, engine/attention/windows.py) limits a row to its last `window`
positions: the kernel starts at the window's first block and position, the torch path masks the rest.

Prefill: `write_chunk` stores a chunk's keys/values, `gather_context` reads a sequence's positions
``0..end-1`` back as ``[kv_heads, end, head_dim]`` for the chunk's causal SDPA (the caller repeats kv
heads for GQA and builds the mask, as `fast_llama` does).

Block tables are int tensors on the cache's device (``[rows, max_blocks]`` for decode, ``[blocks]`` for
one sequence); entries past what a row's span needs are never read by the kernel and masked by the torch
path, but must be valid block ids there (pad with 0). Spans are host integers (a numpy array).

An fp8 pool (`kv_cache_dtype`, attention/kv_quant.py) stores keys and values in one byte: writes quantize
(``x / scale``, clamped, cast), reads dequantize (cast to the compute dtype, times the scale); `scales` is
the layer's (key, value) pair (1.0 for a pool in the model's dtype), which the compiled kernel and the torch path
both apply to the scores and the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention import cpu_kernel, kv_quant
from lmiserve.engine.attention.kv_quant import UNIT, KvFormat
from lmiserve.engine.attention.scores import sink_softmax, soft_cap
from lmiserve.engine.attention.windows import hidden_outside
from lmiserve.engine.core import kv_blocks

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = [
    "AttentionShape",
    "PagedKVCache",
    "flat_index",
    "gather_context",
    "kv_bytes_per_block",
    "paged_cache",
    "paged_decode_attention",
    "torch_decode_attention",
    "write_chunk",
]

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class AttentionShape:
    """The attention dimensions of a model, which shape its KV cache."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PreTrainedConfig) -> AttentionShape:
        cfg: Any = config  # the attribute names are the architecture's (transformers declares none of them)
        if callable(getattr(cfg, "get_text_config", None)):  # a vision-language model: its decoder's
            cfg = cfg.get_text_config()
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(int(cfg.num_hidden_layers), heads, int(kv_heads), int(head_dim))


def paged_cache(
    model: PreTrainedModel, num_blocks: int, block_size: int, kv_format: KvFormat | None = None
) -> PagedKVCache:
    """A `PagedKVCache` of `num_blocks` blocks of `block_size` tokens shaped for `model`'s attention layers,
    stored as `kv_format` says (default: in the model's dtype)."""
    shape = AttentionShape.of(model.config)
    fmt = kv_format or KvFormat()
    return PagedKVCache(
        shape.layers,
        num_blocks,
        block_size,
        shape.kv_heads,
        shape.head_dim,
        model.dtype,
        model.device,
        kv_dtype=fmt.dtype(model.dtype),
        scales=fmt.layer_scales(shape.layers),
    )


def kv_bytes_per_block(model: PreTrainedModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """The memory of one block of `model`'s KV (every layer, K and V, in the pool's element type: the
    model's dtype, or one byte for an fp8 `kv_cache_dtype`)."""
    shape = AttentionShape.of(model.config)
    dtype = kv_quant.storage_dtype(kv_cache_dtype, model.dtype)
    return PagedKVCache.bytes_per_block(shape.layers, block_size, shape.kv_heads, shape.head_dim, dtype)


class PagedKVCache:
    """Per layer, ``keys[layer]`` and ``values[layer]``: ``[num_blocks, kv_heads, block_size, head_dim]``,
    contiguous.

    The pool is allocated uninitialized and zeroed on demand, lowest blocks first (`ensure_zeroed`): a
    pool sized from a memory budget costs nothing at start-up and commits memory as blocks come into
    use. Blocks below `zeroed_blocks` hold zeros or what was written there; a caller raises the mark past
    every block id of a step before the step writes or reads (the torch path reads whole blocks, masked,
    so every value in a block it reads must be finite).

    `dtype` is the compute dtype (the model's); `kv_dtype` what the pool stores (default `dtype`; an fp8
    type for `kv_cache_dtype=fp8`, attention/kv_quant.py), with each layer's (key, value) `scales`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        kv_dtype: torch.dtype | None = None,
        scales: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        if min(num_layers, num_blocks, block_size, kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_blocks, block_size, kv_heads and head_dim must be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.scales = list(scales) if scales is not None else [UNIT] * num_layers
        if len(self.scales) != num_layers:
            raise ValueError(f"{len(self.scales)} KV scales for {num_layers} layers")
        self.device = torch.device(device)
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.keys = [torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in range(num_layers)]
        self.zeroed_blocks = 0

    def ensure_zeroed(self, count: int) -> None:
        """Blocks ``0..count-1`` are usable: those not yet zeroed are zeroed now, in every layer, K and V
        (never again: a block below the mark keeps what is written to it)."""
        if count > self.num_blocks:
            raise ValueError(f"block {count - 1} is past the pool's {self.num_blocks} blocks")
        if count <= self.zeroed_blocks:
            return
        for cache in (*self.keys, *self.values):
            cache[self.zeroed_blocks : count].zero_()
        self.zeroed_blocks = count

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The memory of one block: K and V of `block_size` tokens in every layer (`kv_blocks.blocks_for_memory`
        turns a memory budget into a block count with the same formula)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return kv_blocks.bytes_per_block(num_layers, kv_heads, head_dim, itemsize, block_size)

    @property
    def quantized(self) -> bool:
        """Whether the pool stores fp8 (`kv_cache_dtype=fp8...`): reads dequantize, writes quantize."""
        return kv_quant.is_fp8(self.kv_dtype)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block(
            self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.kv_dtype
        )

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write for forked sequences (`BlockPool.fork`): block ``src`` -> block ``dst`` in every
        layer, K and V. All sources are read before any destination is written."""
        if not pairs:
            return
        self.ensure_zeroed(1 + max(max(pair) for pair in pairs))  # a later zeroing would undo the copy
        src, dst = host_copy.to_device([[s for s, _ in pairs], [d for _, d in pairs]], self.device)
        for cache in (*self.keys, *self.values):
            kv_quant.index_store(cache, dst, cache.index_select(0, src))


# ---- decode: torch (any dtype, any device) ------------------------------------------------------------


def flat_index(blocks: torch.Tensor, offsets: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """Rows of a ``[num_blocks * kv_heads * block_size, head_dim]`` view for tokens at (block, offset):
    ``[tokens, kv_heads]``."""
    heads = torch.arange(kv_heads, device=blocks.device)
    return (blocks[:, None] * kv_heads + heads[None, :]) * block_size + offsets[:, None]


def write_tokens(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    scales: tuple[float, float] = UNIT,
) -> None:
    """Store tokens' keys/values (``[tokens, kv_heads, head_dim]``) each at its (block, offset) (quantized
    with the layer's `scales` in an fp8 pool)."""
    _, kv_heads, block_size, dim = key_cache.shape
    index = flat_index(blocks, offsets, kv_heads, block_size).reshape(-1)
    kv_quant.store(key_cache.view(-1, dim), index, keys.reshape(-1, dim), scales[0])
    kv_quant.store(value_cache.view(-1, dim), index, values.reshape(-1, dim), scales[1])


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[..., blocks]`` block ids -> ``[..., kv_heads, blocks * block_size, head_dim]``."""
    gathered = cache[table]  # [..., blocks, kv_heads, block_size, head_dim]
    *lead, blocks, kv_heads, block_size, dim = gathered.shape
    return gathered.transpose(-4, -3).reshape(*lead, kv_heads, blocks * block_size, dim)


class DecodeIndex(NamedTuple):
    """What every layer's torch decode attention of one step shares (`decode_index`, built once a step):
    the rows' block tables cut to the longest span's blocks, where each row's new key and value go, and
    the mask of the positions past each row's span."""

    tables: torch.Tensor  # [R, width] block ids
    write_blocks: torch.Tensor  # [R]
    write_offsets: torch.Tensor  # [R]
    hidden: torch.Tensor  # [R, 1, 1, width * block_size], True past the row's span
    spans: torch.Tensor  # [R]


def decode_index(
    block_tables: torch.Tensor, spans: npt.ArrayLike, block_size: int, device: torch.device
) -> DecodeIndex:
    """The step's `DecodeIndex` (one host-to-device copy of the spans a step, not one a layer)."""
    host = np.ascontiguousarray(spans, dtype=np.int64)
    span_t = host_copy.to_device(host, device)
    width = -(-int(host.max()) // block_size)
    tables = block_tables.to(device=device, dtype=torch.long)[:, :width]
    last = span_t - 1
    rows = torch.arange(len(host), device=device)
    hidden = torch.arange(width * block_size, device=device)[None, :] >= span_t[:, None]
    return DecodeIndex(tables, tables[rows, last // block_size], last % block_size, hidden[:, None, None, :], span_t)


def torch_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    block_tables: torch.Tensor,
    spans: npt.ArrayLike,
    scale: float,
    index: DecodeIndex | None = None,
    window: int | None = None,
    scales: tuple[float, float] = UNIT,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` with torch ops: matmuls in the cache dtype (the blocks of a cache of another type,
    fp8 or a bf16 one under fp32 queries, cast to the query's dtype; an fp8 one's key scale folded into the scores'
    and its value scale applied to the output), softmax in fp32. Reads the first ``ceil(max(spans) / block_size)``
    columns of `block_tables` for every row (masked past its span, and before its `window`). `index`: the step's
    `decode_index` (else built here)."""
    if len(query) == 0:
        return torch.empty_like(query)
    if index is None:
        index = decode_index(block_tables, spans, key_cache.shape[2], key_cache.device)
    write_tokens(key_cache, value_cache, new_keys, new_values, index.write_blocks, index.write_offsets, scales)
    keys = _gather(key_cache, index.tables)  # [R, kv_heads, width * block_size, head_dim]
    values = _gather(value_cache, index.tables)
    widened = keys.dtype != query.dtype  # an fp8 pool, or a bf16 one under fp32 queries (its scales 1.0)
    if widened:  # the scales are applied to the scores and the output, not to every gathered value
        keys, values = keys.to(query.dtype), values.to(query.dtype)
        scale = scale * scales[0]
    scores = torch.matmul(query.to(keys.dtype), keys.transpose(-1, -2)).float() * scale  # [R, kv, groups, L]
    scores = soft_cap(scores, softcap)
    scores.masked_fill_(hidden_outside(index.spans, index.hidden, window), float("-inf"))
    heads = None if sinks is None else sinks.view(1, *scores.shape[1:3], 1)
    out = torch.matmul(sink_softmax(scores, heads).to(values.dtype), values)
    if widened and scales[1] != 1.0:
        out = out * scales[1]
    return out.to(query.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    block_tables: torch.Tensor,
    spans: npt.ArrayLike,
    scale: float,
    index: DecodeIndex | None = None,
    window: int | None = None,
    scales: tuple[float, float] = UNIT,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``0..R-1``: write ``new_keys``/``new_values`` (``[R, kv_heads, head_dim]``) at position
    ``p = spans[r] - 1`` of row r (block ``block_tables[r, p // block_size]``, offset ``p % block_size``)
    in the layer caches (``[num_blocks, kv_heads, block_size, head_dim]``), then attend ``query``
    (``[R, kv_heads, groups, head_dim]``) over positions ``0..spans[r]-1`` (the last `window` of them when
    given) through the block table. Returns ``[R, kv_heads, groups, head_dim]``. The compiled kernel where
    `cpu_kernel.available` (an fp32, bf16 or fp8 cache on CPU), torch otherwise. `scales`: the layer's
    (key, value) scales of an fp8 cache; `softcap`: the scores soft-capped (Gemma 2's), `sinks`: each head's sink
    logit (``[heads]``, gpt-oss's): both torch ops."""
    args = (query, key_cache, value_cache, new_keys, new_values, block_tables, spans, scale)
    if softcap is None and sinks is None and cpu_kernel.available(key_cache.dtype, key_cache.device):
        return cpu_kernel.compiled_decode_attention(*args, window=window, scales=scales)
    return torch_decode_attention(*args, index, window, scales, softcap, sinks)


# ---- prefill --------------------------------------------------------------------------------------------


def write_chunk(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scales: tuple[float, float] = UNIT,
) -> None:
    """Store a chunk's keys/values (``[length, kv_heads, head_dim]``) at positions ``start..start+length-1``
    of the sequence whose blocks are `block_table` (``[blocks]``; quantized with `scales` in an fp8 pool)."""
    length = keys.shape[0]
    if length == 0:
        return
    block_size = key_cache.shape[2]
    device = key_cache.device
    positions = torch.arange(start, start + length, device=device)
    table = block_table.to(device=device, dtype=torch.long)
    write_tokens(key_cache, value_cache, keys, values, table[positions // block_size], positions % block_size, scales)


def gather_context(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    end: int,
    dtype: torch.dtype | None = None,
    scales: tuple[float, float] = UNIT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0..end-1`` of the sequence whose blocks are `block_table`, as (keys, values), each
    ``[kv_heads, end, head_dim]`` (fresh tensors, not views of the cache), in `dtype` where given: an fp8 cache's
    dequantized with the layer's `scales` (`dtype` required then), a bf16 one's widened for an fp32 model."""
    block_size = key_cache.shape[2]
    table = block_table.to(device=key_cache.device, dtype=torch.long)[: -(-end // block_size)]
    keys, values = _gather(key_cache, table)[:, :end], _gather(value_cache, table)[:, :end]
    if kv_quant.is_fp8(key_cache.dtype) and dtype is None:
        raise ValueError("an fp8 KV cache is read back in a compute dtype: pass dtype")
    if dtype is not None and key_cache.dtype != dtype:  # (fp8, or a bf16 pool under an fp32 model)
        keys, values = kv_quant.dequantize(keys, dtype, scales[0]), kv_quant.dequantize(values, dtype, scales[1])
    return keys, values
