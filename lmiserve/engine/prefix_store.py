"""The tensors of the prefix cache: a pool of KV blocks beside the slot cache (engine/prefix_cache.py
decides which block holds what).

Per layer one key and one value tensor ``[num_blocks, kv_heads, block_size, head_dim]`` in the slot
cache's dtype, allocated once (`torch.empty`: the pages are committed as blocks are first written, so
the process grows with what is cached, up to the pool's size, never beyond it).
"""

from __future__ import annotations

import torch

from lmiserve.engine.kv_cache import SlotKVCache


def bytes_per_token(cache: SlotKVCache) -> int:
    """Bytes of KV one token takes (keys and values of every layer)."""
    keys = cache.keys[0]
    return 2 * cache.num_layers * keys.shape[1] * keys.shape[3] * keys.element_size()


class PrefixStore:
    def __init__(self, cache: SlotKVCache, num_blocks: int, block_size: int) -> None:
        self.cache = cache
        self.block_size = block_size
        self.num_blocks = num_blocks
        like = cache.keys[0]
        shape = (num_blocks, like.shape[1], block_size, like.shape[3])
        self.keys = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(cache.num_layers)]
        self.values = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(cache.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def save(self, slot: int, blocks: list[tuple[int, int]]) -> None:
        """Copy block ``number`` of `slot` (positions ``number*B .. number*B+B-1``) into pool block
        ``index`` for each (number, index) of `blocks`."""
        if not blocks:
            return
        size = self.block_size
        positions = torch.tensor(
            [number * size + i for number, _ in blocks for i in range(size)], device=self.cache.keys[0].device
        )
        index = torch.tensor([i for _, i in blocks], device=positions.device)
        for store, pool in ((self.cache.keys, self.keys), (self.cache.values, self.values)):
            for layer, target in zip(store, pool, strict=True):
                rows = layer[slot].index_select(1, positions)  # [kv_heads, n * B, head_dim]
                heads, _, dim = rows.shape
                target.index_copy_(0, index, rows.view(heads, len(blocks), size, dim).transpose(0, 1))

    def load(self, slot: int, blocks: tuple[int, ...], tokens: int) -> None:
        """Copy the first `tokens` positions held by pool `blocks` (in order) into `slot` from position 0."""
        if tokens <= 0:
            return
        self.cache.ensure_capacity(tokens)
        index = torch.tensor(blocks, device=self.cache.keys[0].device)
        for store, pool in ((self.cache.keys, self.keys), (self.cache.values, self.values)):
            for layer, source in zip(store, pool, strict=True):
                rows = source.index_select(0, index)  # [n, kv_heads, B, head_dim]
                n, heads, size, dim = rows.shape
                layer[slot, :, :tokens] = rows.transpose(0, 1).reshape(heads, n * size, dim)[:, :tokens]
