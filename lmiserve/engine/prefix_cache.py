"""Automatic prefix caching: which token prefixes have their KV kept, and where (pure Python, no torch).

The KV of a sequence's tokens is kept in fixed blocks of `block_size` tokens in a bounded pool of
`num_blocks` blocks (`engine/prefix_store.py` holds the tensors; the runner copies them). A block is
found by its chain key ``(parent block id, its token ids)``, the key vLLM's automatic prefix caching
hashes, but compared exactly (a dict keyed by the token ids themselves): two different prefixes never
share a block, whatever their hashes. The KV at a position depends only on the tokens up to it, so a
block found through the chain of a prompt's leading blocks holds exactly the KV that prompt would
compute there (up to the rounding of a differently shaped forward pass, as batching already has).

Eviction is least recently used. A lookup or a store touches a chain leaf first and root last, so a
chain's leaves are evicted before its root and a block's descendants seldom outlive it (one that does
is unreachable and goes at its turn).

The scheduler plans with this index: a store (`store`) hands out pool blocks the runner then fills
from a slot, a lookup (`match`) hands out blocks the runner copies into a slot in the same step, after
that step's stores. Both are planned before the step runs, so a block planned for a copy is never
reused by a store of the same step (every store of a step is planned before its lookups).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ROOT = 0  # the parent id of a prompt's first block


@dataclass(frozen=True)
class _Block:
    id: int  # unique for the life of the index (never reused): children name their parent by it
    index: int  # its place in the pool


@dataclass(frozen=True)
class PrefixMatch:
    """The cached head of a prompt: the pool blocks to copy, in order, and how many tokens of them."""

    blocks: tuple[int, ...]
    tokens: int


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a prefix cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # LRU first
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest index first
        self._next_id = ROOT + 1

    @property
    def used_blocks(self) -> int:
        return len(self._blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def clear(self) -> None:
        self._blocks.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _chunks(self, tokens: list[int], limit: int) -> list[tuple[int, ...]]:
        size = self.block_size
        count = min(len(tokens) // size, limit)
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(count)]

    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest chain of cached blocks that `tokens` starts with; at most ``len(tokens) - 1``
        tokens of it are used, so at least one token is left to compute (its logits start the output)."""
        parent, found = ROOT, []
        for chunk in self._chunks(tokens, self.num_blocks):
            block = self._blocks.get((parent, chunk))
            if block is None:
                break
            found.append((parent, chunk))
            parent = block.id
        self._touch(found)
        count = min(len(found) * self.block_size, max(len(tokens) - 1, 0))
        used = -(-count // self.block_size)  # the blocks holding those tokens (the last maybe in part)
        return PrefixMatch(tuple(self._blocks[key].index for key in found[:used]), count)

    def store(self, tokens: list[int]) -> list[tuple[int, int]]:
        """Make room for the full blocks of `tokens` that are not cached yet; returns (block number in
        `tokens`, pool block) of each new one, which the caller must fill before anyone reads it."""
        parent, chain, new = ROOT, [], []
        for number, chunk in enumerate(self._chunks(tokens, self.num_blocks)):
            key = (parent, chunk)
            block = self._blocks.get(key)
            if block is None:
                index = self._allocate()
                block = _Block(self._next_id, index)
                self._next_id += 1
                self._blocks[key] = block
                new.append((number, index))
            else:
                self._blocks.move_to_end(key)  # never the eviction victim of its own chain
            chain.append(key)
            parent = block.id
        self._touch(chain)
        return new

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        _, victim = self._blocks.popitem(last=False)
        return victim.index

    def _touch(self, chain: list[tuple[int, tuple[int, ...]]]) -> None:
        """Most recently used: the root last (so leaves go first)."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)
