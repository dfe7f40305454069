"""The block KV cache's allocator: a pool of fixed-size blocks, per-request block tables, and the prefix
cache as shared blocks (pure Python: no torch, no asyncio; the scheduler owns it, the runners read it).

The KV memory is one pool of ``num_blocks`` blocks of ``block_size`` token slots each (sized from a
memory budget by `blocks_for_memory`). A request owns a `BlockTable`: the ids of its blocks in order and
how many tokens they hold (the token at position ``p`` lives in slot ``p % block_size`` of block
``blocks[p // block_size]``; every block but the last is full). `BlockPool.allocate` grows a table by a
number of tokens, taking the blocks it needs all at once or none at all, so a scheduler that gets
``False`` can preempt a victim (`BlockPool.free`) and retry without having half-grown anything. Every
block has a reference count: the number of tables that hold it. A block at 0 is free.

A full block is also identified by its contents: the hash of its parent block's hash and its token ids
(a chain, so a block's hash names the whole prefix up to its end, not only its own tokens). The first
block's parent is a root derived from the request's optional ``cache_salt``: requests with different
salts never share a block. Hashes are BLAKE2b over a fixed little-endian encoding of the token ids, not
Python's `hash`, so they are the same in every process and a crafted prompt cannot be made to collide
into another tenant's blocks. After the KV of a request's tokens is computed, `BlockPool.cache_full_blocks`
registers its newly full blocks under their hashes (a hash already registered by another block keeps
that block; the duplicate simply stays unregistered). `BlockPool.match_prefix` walks a prompt's chain
through that index and returns the blocks of its longest cached head; passing them to `allocate` shares
them (reference count + 1) instead of computing them again: the prefix cache never copies. Only full
blocks are ever registered or shared for reading; the last, partial block of a table is written by its
owner alone. `BlockPool.fork` gives ``n``/``best_of`` siblings the full blocks of one prefilled prompt
and a fresh block for the partial tail, with the block copy the runner must perform.

Free blocks come in two kinds. Plain free blocks hold nothing anyone can find; free blocks that still
carry a registered hash are the prefix cache proper: they stay findable (and shareable) until evicted,
least recently freed first, and only when a new block is needed and no plain free block is left. A
table is freed tail first, so the tail of a sequence is evicted before its head (a head evicted first
would leave its tail unreachable through the chain). Evicting a block drops its hash, so a later lookup
misses it. Every operation costs O(blocks it touches): the free lists are a stack and an ordered dict,
and a table remembers the hashes of its full blocks so no block is hashed twice.

`BlockPool.usage` is vLLM's ``kv_cache_usage_perc`` (blocks in use / pool); `prefix_cache_queries` and
`prefix_cache_hits` count tokens, as vLLM's ``prefix_cache_queries_total``/``_hits_total`` do.
`BlockPool.check` verifies every invariant of the pool (and, given the live tables, that the reference
counts match them); the tests call it after every operation.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lmiserve.engine.core.kv_fits import blocks_for_tokens
from lmiserve.engine.text.images import ImageSpan, span_digests

__all__ = [
    "BlockPool",
    "BlockTable",
    "PrefixMatch",
    "block_hash",
    "blocks_for_memory",
    "bytes_per_block",
    "root_hash",
]

Spans = Sequence[ImageSpan] | None  # a VLM prompt's image spans (their digests key the blocks they fall in)
_DIGEST_SIZE = 32
_ROOT = hashlib.blake2b(b"lmiserve.kv_blocks.root", digest_size=_DIGEST_SIZE).digest()


def root_hash(salt: str | None = None) -> bytes:
    """The parent hash of a prompt's first block: a constant, or one derived from `salt` (vLLM's
    ``cache_salt``), so requests with different salts share no block."""
    if salt is None:
        return _ROOT
    return hashlib.blake2b(b"lmiserve.kv_blocks.salt\x00" + salt.encode("utf-8"), digest_size=_DIGEST_SIZE).digest()


def block_hash(parent: bytes, tokens: Sequence[int], images: Sequence[str] = ()) -> bytes:
    """The chain hash of a full block: BLAKE2b of its parent's hash and its token ids (signed 64-bit,
    little-endian; the parent is fixed-length, so the encoding is unambiguous), then the digests of the
    images whose tokens the block holds (a VLM's prompt: the same ids stand for any image of a size)."""
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    for image in images:
        digest.update(b"\x00image:" + image.encode("ascii", "replace"))
    return digest.digest()


def bytes_per_block(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int = 16) -> int:
    """The memory of one block: K and V of `block_size` tokens in every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes * block_size


def blocks_for_memory(
    memory_bytes: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, block_size: int = 16
) -> int:
    """How many whole blocks (K and V, every layer) fit in `memory_bytes`."""
    if min(layers, kv_heads, head_dim, dtype_bytes, block_size) < 1:
        raise ValueError("layers, kv_heads, head_dim, dtype_bytes and block_size must be positive")
    return max(0, memory_bytes) // bytes_per_block(layers, kv_heads, head_dim, dtype_bytes, block_size)


@dataclass
class BlockTable:
    """One request's blocks, in token order, and how many tokens they hold (computed or about to be).

    `block_hashes` are the chain hashes of its leading full blocks as far as they are known (shared from
    the cache, or computed by `BlockPool.cache_full_blocks`); the pool keeps them up to date. A freed
    table is empty again and can be reused (a preempted request recomputes into it).
    """

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


class PrefixMatch(NamedTuple):
    """The cached head of a prompt: the blocks that hold it, in order, and how many tokens they hold."""

    blocks: tuple[int, ...]
    num_cached_tokens: int


class BlockPool:
    """Blocks ``0 .. num_blocks - 1``, their reference counts, and the prefix cache's hash index."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._last_use = [0] * num_blocks  # the tick of its last allocation or release
        self._tick = 0
        self._index: dict[bytes, int] = {}  # registered hash -> the one block that holds it
        self._plain = list(range(num_blocks - 1, -1, -1))  # free and unhashed; pop() gives the lowest first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and hashed, least recently freed first
        self._num_used = 0
        self.prefix_cache_queries = 0  # tokens looked up by match_prefix
        self.prefix_cache_hits = 0  # of them, tokens found cached

    # ---- sizes ---------------------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return blocks_for_tokens(num_tokens, self.block_size)

    def never_fits(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` tokens needs more blocks than the whole pool has."""
        return self.blocks_needed(num_tokens) > self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds (plain free ones and evictable cached ones)."""
        return self.num_blocks - self._num_used

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a hash, in use or evictable."""
        return len(self._index)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def usage(self) -> float:
        """Blocks in use / pool (vLLM's ``kv_cache_usage_perc``, a fraction in [0, 1])."""
        return self._num_used / self.num_blocks

    def slot(self, table: BlockTable, position: int) -> int:
        """The pool-wide slot of the token at `position` of `table` (block id * block_size + offset)."""
        if not 0 <= position < table.num_tokens:
            raise IndexError(f"position {position} outside the table's {table.num_tokens} tokens")
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    # ---- the prefix cache ----------------------------------------------------------------------------

    def match_prefix(
        self, tokens: Sequence[int], salt: str | None = None, max_tokens: int | None = None, images: Spans = None
    ) -> PrefixMatch:
        """The longest head of `tokens` held by cached full blocks (under `salt`), at most `max_tokens`
        tokens long (a scheduler passes ``len(tokens) - 1``, so one token is left to compute for logits).

        Counts ``len(tokens)`` queried tokens and the matched ones as hits (with prefix caching off: an
        empty match, nothing counted). Share the blocks by passing them to `allocate` before anything
        else allocates (an allocation may evict them; `allocate` refuses blocks no longer cached). `images`: a
        VLM prompt's image spans, whose digests key the blocks their tokens fall in."""
        if not self.enable_prefix_caching:
            return PrefixMatch((), 0)
        limit = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        bs = self.block_size
        blocks: list[int] = []
        parent = root_hash(salt)
        for start in range(0, limit - bs + 1, bs):
            parent = block_hash(parent, tokens[start : start + bs], span_digests(images, start, start + bs))
            block = self._index.get(parent)
            if block is None:
                break
            blocks.append(block)
        cached = len(blocks) * bs
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += cached
        return PrefixMatch(tuple(blocks), cached)

    def cache_full_blocks(
        self, table: BlockTable, tokens: Sequence[int], salt: str | None = None, images: Spans = None
    ) -> int:
        """Register the table's full blocks among `tokens` (the head of its tokens whose KV is now
        computed) that are not registered yet, so later requests can share them. Returns how many blocks
        got a new hash (a hash another block already holds is not registered twice)."""
        if not self.enable_prefix_caching:
            return 0
        if len(tokens) > table.num_tokens:
            raise ValueError(f"{len(tokens)} tokens given for a table of {table.num_tokens}")
        bs = self.block_size
        hashes = table.block_hashes
        parent = hashes[-1] if hashes else root_hash(salt)
        registered = 0
        for i in range(len(hashes), len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], span_digests(images, i * bs, (i + 1) * bs))
            hashes.append(parent)
            block = table.blocks[i]
            if self._hash[block] is None and parent not in self._index:
                self._hash[block] = parent
                self._index[parent] = block
                registered += 1
        return registered

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is in use: the
        hashes of blocks in use would survive the reset, as vLLM refuses for the same reason."""
        if self._num_used:
            return False
        for block in self._evictable:
            self._hash[block] = None
            self._plain.append(block)
        self._evictable.clear()
        self._index.clear()
        return True

    # ---- allocation ----------------------------------------------------------------------------------

    def allocate(self, table: BlockTable, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Grow `table` to hold `num_new_tokens` more tokens, after `cached_blocks` (the blocks of a
        `match_prefix`, shared: only into an empty table). All or nothing: False, and nothing changed,
        when the free blocks (less the cached ones this would take out of the evictable ones) are too few."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not cached_blocks and table.num_tokens + num_new_tokens <= len(table.blocks) * self.block_size:
            table.num_tokens += num_new_tokens  # its last block has room (most decode steps): no block taken
            self._tick += 1
            return True
        if cached_blocks:
            self._check_shareable(table, cached_blocks)
        total = table.num_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        new = self.blocks_needed(total) - len(table.blocks) - len(cached_blocks)
        revived = sum(1 for block in cached_blocks if self._ref[block] == 0)
        if new > self.num_free_blocks - revived:
            return False
        self._tick += 1
        for block in cached_blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
                self._num_used += 1
            self._ref[block] += 1
            self._last_use[block] = self._tick
            digest = self._hash[block]
            assert digest is not None  # checked by _check_shareable
            table.blocks.append(block)
            table.block_hashes.append(digest)
        for _ in range(new):
            table.blocks.append(self._take())
        table.num_tokens = total
        return True

    def free(self, table: BlockTable) -> None:
        """Release the table's blocks, tail first (so a cached tail is evicted before its head), and
        empty the table."""
        self._tick += 1
        for block in reversed(table.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._num_used -= 1
                self._last_use[block] = self._tick
                if self._hash[block] is None:
                    self._plain.append(block)
                else:
                    self._evictable[block] = None
        table.blocks.clear()
        table.block_hashes.clear()
        table.num_tokens = 0

    def fork(self, table: BlockTable) -> tuple[BlockTable, list[tuple[int, int]]] | None:
        """A sibling of `table` (``n``/``best_of``, after its prompt is computed): it shares every full
        block; its partial last block, which both will write, is a new block the runner fills by copying
        the returned ``(source, destination)`` blocks. None, and nothing changed, when no block is free."""
        full = table.num_tokens // self.block_size
        partial = len(table.blocks) > full
        if partial and self.num_free_blocks == 0:
            return None
        self._tick += 1
        child = BlockTable(list(table.blocks[:full]), table.num_tokens, list(table.block_hashes))
        for block in child.blocks:
            self._ref[block] += 1
            self._last_use[block] = self._tick
        copies: list[tuple[int, int]] = []
        if partial:
            dst = self._take()
            child.blocks.append(dst)
            copies.append((table.blocks[full], dst))
        return child, copies

    def _take(self) -> int:
        """A free block for new contents: a plain one, else the least recently freed cached one (which
        loses its hash). The caller has checked that one is free."""
        if self._plain:
            block = self._plain.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            digest = self._hash[block]
            assert digest is not None
            del self._index[digest]
            self._hash[block] = None
        self._ref[block] = 1
        self._last_use[block] = self._tick
        self._num_used += 1
        return block

    def _check_shareable(self, table: BlockTable, cached_blocks: Sequence[int]) -> None:
        if table.blocks or table.num_tokens:
            raise ValueError("cached blocks can only start an empty table")
        if len(set(cached_blocks)) != len(cached_blocks):
            raise ValueError("a cached block appears twice")
        for block in cached_blocks:
            if not 0 <= block < self.num_blocks or self._hash[block] is None:
                raise ValueError(f"block {block} is not cached (evicted since match_prefix?)")

    # ---- invariants ----------------------------------------------------------------------------------

    def check(self, tables: Iterable[BlockTable] | None = None) -> None:
        """Raise AssertionError unless the pool is consistent: every block free (reference count 0, in
        exactly one free list: evictable iff hashed) or in use; the hash index and the blocks' hashes
        agree; the counts add up; the evictable blocks in release order. Given every live table, also
        that the reference counts are exactly how many tables hold each block, and each table is sound."""

        def fail(message: str) -> None:
            raise AssertionError(message)

        plain = set(self._plain)
        if len(plain) != len(self._plain):
            fail("a block is twice in the plain free list")
        if plain & self._evictable.keys():
            fail("a block is both plain free and evictable")
        free = plain | self._evictable.keys()
        for block in range(self.num_blocks):
            ref, digest = self._ref[block], self._hash[block]
            if ref < 0:
                fail(f"block {block} has reference count {ref}")
            if (ref == 0) != (block in free):
                fail(f"block {block}: reference count {ref} but {'' if block in free else 'not '}free")
            if block in plain and digest is not None:
                fail(f"plain free block {block} has a hash")
            if block in self._evictable and digest is None:
                fail(f"evictable block {block} has no hash")
            if digest is not None and self._index.get(digest) != block:
                fail(f"block {block}'s hash is not indexed to it")
        for digest, block in self._index.items():
            if self._hash[block] != digest:
                fail(f"the index names block {block} for a hash it does not hold")
        used = sum(1 for ref in self._ref if ref > 0)
        if used != self._num_used or used + len(free) != self.num_blocks:
            fail(f"counts: {used} used, {self._num_used} counted, {len(free)} free of {self.num_blocks}")
        ticks = [self._last_use[block] for block in self._evictable]
        if ticks != sorted(ticks):
            fail("evictable blocks out of release order")
        if not self.enable_prefix_caching and self._index:
            fail("hashes registered with prefix caching off")
        if self.prefix_cache_hits > self.prefix_cache_queries:
            fail("more prefix cache hits than queries")
        if tables is None:
            return
        counts = [0] * self.num_blocks
        for table in tables:
            if len(table.blocks) != self.blocks_needed(table.num_tokens):
                fail(f"a table of {table.num_tokens} tokens holds {len(table.blocks)} blocks")
            if len(set(table.blocks)) != len(table.blocks):
                fail("a table holds a block twice")
            if len(table.block_hashes) > table.num_tokens // self.block_size:
                fail("a table knows hashes of blocks that are not full")
            for block, digest in zip(table.blocks, table.block_hashes):
                if self._hash[block] is not None and self._hash[block] != digest:
                    fail(f"block {block} is registered under another hash than its table's")
            for block in table.blocks:
                counts[block] += 1
        if counts != self._ref:
            bad = [b for b in range(self.num_blocks) if counts[b] != self._ref[b]]
            fail(f"reference counts differ from the live tables at blocks {bad[:8]}")
