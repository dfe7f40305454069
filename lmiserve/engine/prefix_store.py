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
        self.kv_heads, self.head_dim = like.shape[1], like.shape[3]
        # per layer [kv_heads, blocks, block_size * head_dim]: a block of one head is one contiguous row
        shape = (self.kv_heads, num_blocks, block_size * self.head_dim)
        self.keys = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(cache.num_layers)]
        self.values = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(cache.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _rows(self, layer: torch.Tensor, slot: int, head: int, first: int, count: int) -> torch.Tensor:
        """Blocks ``first .. first+count-1`` of one head of `slot` as ``[count, block_size * head_dim]``
        (a view: positions of one head are contiguous in the slot cache)."""
        size = self.block_size
        return layer[slot, head, first * size : (first + count) * size].view(count, size * self.head_dim)

    def save(self, slot: int, blocks: list[tuple[int, int]]) -> None:
        """Copy block ``number`` of `slot` (positions ``number*B .. number*B+B-1``) into pool block
        ``index`` for each (number, index) of `blocks`: one copy per run of consecutive numbers, head
        and layer."""
        device = self.cache.keys[0].device
        runs: list[tuple[int, list[int]]] = []  # (first block number, pool indices)
        for number, index in blocks:
            if runs and runs[-1][0] + len(runs[-1][1]) == number:
                runs[-1][1].append(index)
            else:
                runs.append((number, [index]))
        for first, indices in runs:
            at = torch.tensor(indices, device=device)
            for store, pool in ((self.cache.keys, self.keys), (self.cache.values, self.values)):
                for layer, target in zip(store, pool, strict=True):
                    for head in range(self.kv_heads):
                        target[head].index_copy_(0, at, self._rows(layer, slot, head, first, len(indices)))

    def load(self, slot: int, blocks: tuple[int, ...], tokens: int) -> None:
        """Copy pool `blocks` (in order) into `slot` from position 0; the caller uses the first `tokens`
        positions (whole blocks are copied: the positions after `tokens` are computed again over them)."""
        if tokens <= 0 or not blocks:
            return
        self.cache.ensure_capacity(len(blocks) * self.block_size)
        index = torch.tensor(blocks, device=self.cache.keys[0].device)
        for store, pool in ((self.cache.keys, self.keys), (self.cache.values, self.values)):
            for layer, source in zip(store, pool, strict=True):
                for head in range(self.kv_heads):
                    torch.index_select(source[head], 0, index, out=self._rows(layer, slot, head, 0, len(blocks)))
