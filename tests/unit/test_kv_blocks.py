"""The block KV cache's allocator as a pure state machine (no torch): allocation all or nothing, prefix
sharing through the hash chain (refcounts, cached tokens, salts, partial blocks never shared), LRU
eviction order, fork with copy-on-write of the partial tail, never_fits, reset, usage, sizing, and random
sequences of operations with the invariants checked after each one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, precondition, rule

from lmiserve.engine.core.kv_blocks import (
    BlockPool,
    BlockTable,
    PrefixMatch,
    block_hash,
    blocks_for_memory,
    bytes_per_block,
    root_hash,
)

BS = 4


def admit(pool: BlockPool, tokens: list[int], salt: str | None = None) -> tuple[BlockTable, int]:
    """What a scheduler does for a new prompt: look up its head, share it, allocate the rest, and
    (after the forward pass) register its full blocks. Returns the table and its cached tokens."""
    table = BlockTable()
    blocks, cached = pool.match_prefix(tokens, salt, max_tokens=len(tokens) - 1)
    assert pool.allocate(table, len(tokens) - cached, blocks)
    pool.cache_full_blocks(table, tokens, salt)
    return table, cached


# ---- allocation --------------------------------------------------------------------------------------


def test_allocate_grows_block_by_block():
    pool = BlockPool(8, BS)
    table = BlockTable()
    assert pool.allocate(table, 5)
    assert table.blocks == [0, 1] and table.num_tokens == 5
    assert pool.allocate(table, 3)  # fills block 1, no new block
    assert table.blocks == [0, 1] and table.num_tokens == 8
    assert pool.allocate(table, 1)
    assert table.blocks == [0, 1, 2] and table.num_tokens == 9
    assert pool.allocate(table, 0)
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    assert pool.slot(table, 0) == 0 and pool.slot(table, 5) == 5 and pool.slot(table, 8) == 8
    pool.check([table])
    with pytest.raises(ValueError):
        pool.allocate(table, -1)
    with pytest.raises(IndexError):
        pool.slot(table, 9)


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4, BS)
    a, b = BlockTable(), BlockTable()
    assert pool.allocate(a, 10)  # 3 blocks
    assert not pool.allocate(b, 5)  # needs 2, 1 free
    assert b == BlockTable() and pool.num_free_blocks == 1
    assert not pool.allocate(a, 7)  # 17 tokens need 5 blocks: 2 more, 1 free
    assert a.num_tokens == 10 and len(a.blocks) == 3
    pool.check([a, b])
    assert pool.allocate(b, 4)  # exactly the last block
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    pool.check([a, b])
    pool.free(a)  # a preempted: its blocks come back, its table is empty and reusable
    assert a == BlockTable() and pool.num_free_blocks == 3
    assert pool.allocate(a, 12)
    pool.check([a, b])


def test_blocks_needed_and_never_fits():
    pool = BlockPool(10, 16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert not pool.never_fits(160) and pool.never_fits(161)


def test_usage_and_counts():
    pool = BlockPool(10, BS)
    assert pool.usage() == 0.0
    table = BlockTable()
    pool.allocate(table, 4 * BS)
    assert pool.usage() == pytest.approx(0.4)
    assert (pool.num_used_blocks, pool.num_free_blocks) == (4, 6)
    pool.free(table)
    assert pool.usage() == 0.0 and pool.num_free_blocks == 10
    pool.check([])


def test_sizing():
    # K and V of 16 tokens in 2 layers, 4 heads of 8 dimensions, 2 bytes each
    assert bytes_per_block(2, 4, 8, 2, 16) == 2 * 2 * 4 * 8 * 2 * 16 == 4096
    assert blocks_for_memory(4096 * 10 + 4095, 2, 4, 8, 2, 16) == 10
    assert blocks_for_memory(0, 2, 4, 8, 2) == 0
    with pytest.raises(ValueError):
        blocks_for_memory(1 << 20, 0, 4, 8, 2)
    with pytest.raises(ValueError):
        BlockPool(0)


# ---- sharing -----------------------------------------------------------------------------------------


def test_two_requests_share_a_prefix():
    pool = BlockPool(16, BS)
    system = list(range(100, 110))  # 2 full blocks and 2 tokens
    a, cached_a = admit(pool, [*system, 1, 2, 3])
    assert cached_a == 0 and pool.num_cached_blocks == 3  # 13 tokens: 3 full blocks
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (13, 0)
    b, cached_b = admit(pool, [*system, 7, 8])
    assert cached_b == 2 * BS
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert [pool._ref[x] for x in a.blocks[:2]] == [2, 2]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (13 + 12, 8)
    assert pool.num_used_blocks == 4 + 1  # a's 4 blocks, and b's own third one
    pool.check([a, b])
    pool.free(a)  # the shared blocks stay in use by b
    assert [pool._ref[x] for x in b.blocks[:2]] == [1, 1]
    pool.check([b])
    pool.free(b)
    pool.check([])
    c, cached_c = admit(pool, [*system, 9])  # the cache outlives the requests
    assert cached_c == 2 * BS
    assert pool.num_evictable_blocks == 2  # the third full blocks of a and b; c shares the first two
    pool.check([c])


def test_a_whole_prompt_cached_leaves_one_token_to_compute():
    pool = BlockPool(8, BS)
    prompt = list(range(8))
    a, _ = admit(pool, prompt)
    assert pool.match_prefix(prompt) == PrefixMatch(tuple(a.blocks), 8)
    b, cached = admit(pool, prompt)  # max_tokens = 7: only the first block
    assert cached == 4 and b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    pool.check([a, b])


def test_the_chain_keys_the_whole_prefix():
    pool = BlockPool(8, BS)
    admit(pool, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # the same second block after a different first block is not a hit
    assert pool.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0]).num_cached_tokens == 0
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 9, 0]).num_cached_tokens == 4
    assert block_hash(root_hash(), [1, 2, 3, 4]) != block_hash(root_hash(), [1, 2, 3, 5])
    assert block_hash(root_hash(), [1, 2, 3, 4]) == block_hash(root_hash(None), (1, 2, 3, 4))


def test_salts_isolate_tenants():
    pool = BlockPool(16, BS)
    prompt = list(range(9))
    admit(pool, prompt, salt="tenant-a")
    assert pool.match_prefix(prompt, salt="tenant-a").num_cached_tokens == 8
    assert pool.match_prefix(prompt, salt="tenant-b").num_cached_tokens == 0
    assert pool.match_prefix(prompt).num_cached_tokens == 0
    assert pool.match_prefix(prompt, salt="").num_cached_tokens == 0
    admit(pool, prompt)
    assert pool.match_prefix(prompt).num_cached_tokens == 8
    assert len({root_hash(None), root_hash(""), root_hash("a")}) == 3
    pool.check()


def test_partial_blocks_are_never_shared():
    pool = BlockPool(8, BS)
    a, _ = admit(pool, [1, 2, 3, 4, 5, 6])
    assert pool.num_cached_blocks == 1  # the partial second block is not registered
    b, cached = admit(pool, [1, 2, 3, 4, 5, 6, 7])
    assert cached == 4 and b.blocks[1] != a.blocks[1]
    # filling the block registers it
    assert pool.allocate(a, 2)
    assert pool.cache_full_blocks(a, [1, 2, 3, 4, 5, 6, 7, 8]) == 1
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).blocks == tuple(a.blocks[:2])
    pool.check([a, b])


def test_a_duplicate_block_is_not_registered_twice():
    pool = BlockPool(8, BS)
    prompt = [1, 2, 3, 4, 5]
    a, b = BlockTable(), BlockTable()
    assert pool.allocate(a, 5) and pool.allocate(b, 5)  # both computed before either was cached
    assert pool.cache_full_blocks(a, prompt) == 1
    assert pool.cache_full_blocks(b, prompt) == 0  # b keeps its block, unregistered
    assert pool.match_prefix(prompt).blocks == (a.blocks[0],)
    assert b.block_hashes == a.block_hashes
    pool.check([a, b])
    pool.free(b)  # b's duplicate goes back as a plain free block
    assert pool.num_evictable_blocks == 0 and pool.num_cached_blocks == 1
    pool.check([a])
    pool.free(a)
    assert pool.num_evictable_blocks == 1
    pool.check([])


def test_cache_full_blocks_hashes_each_block_once():
    pool = BlockPool(8, BS)
    table = BlockTable()
    tokens = list(range(12))
    pool.allocate(table, 12)
    assert pool.cache_full_blocks(table, tokens[:5]) == 1  # chunked prefill: the first chunk
    assert pool.cache_full_blocks(table, tokens[:5]) == 0
    assert pool.cache_full_blocks(table, tokens) == 2
    assert len(table.block_hashes) == 3
    with pytest.raises(ValueError):
        pool.cache_full_blocks(table, [*tokens, 0])
    pool.check([table])


def test_stale_cached_blocks_are_refused():
    pool = BlockPool(2, BS)
    a, _ = admit(pool, [1, 2, 3, 4, 5])
    pool.free(a)
    match = pool.match_prefix([1, 2, 3, 4, 5])
    assert match.num_cached_tokens == 4
    filler = BlockTable()
    assert pool.allocate(filler, 8)  # evicts the cached block
    with pytest.raises(ValueError, match="not cached"):
        pool.allocate(BlockTable(), 1, match.blocks)
    with pytest.raises(ValueError, match="empty table"):
        pool.allocate(filler, 1, match.blocks)


def test_sharing_evictable_blocks_counts_against_the_free_ones():
    pool = BlockPool(3, BS)
    a, _ = admit(pool, list(range(9)))  # 3 blocks, 2 full ones cached
    pool.free(a)
    blocks, cached = pool.match_prefix([*range(8), 50, 51, 52, 53, 54])
    assert cached == 8
    table = BlockTable()
    # 2 shared (taken out of the 3 free) + 2 new for 5 tokens: 1 short, nothing changes
    assert not pool.allocate(table, 5, blocks)
    assert table == BlockTable() and pool.num_evictable_blocks == 2
    pool.check([])
    assert pool.allocate(table, 4, blocks)
    assert table.blocks[:2] == list(blocks) and pool.num_free_blocks == 0
    assert table.num_tokens == 12
    pool.check([table])


# ---- eviction ----------------------------------------------------------------------------------------


def test_plain_free_blocks_go_before_cached_ones():
    pool = BlockPool(4, BS)
    a, _ = admit(pool, [1, 2, 3, 4, 5, 6, 7, 8])  # 2 cached blocks
    pool.free(a)
    b = BlockTable()
    assert pool.allocate(b, 8)  # the 2 plain free blocks
    assert pool.num_cached_blocks == 2
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_cached_tokens == 8
    pool.check([b])


def test_eviction_is_least_recently_freed_first_and_tail_before_head():
    pool = BlockPool(6, BS)
    x, _ = admit(pool, list(range(100, 112)))  # 3 full blocks
    y, _ = admit(pool, list(range(200, 212)))
    x_blocks, y_blocks = list(x.blocks), list(y.blocks)
    pool.free(y)  # y first: the least recently freed
    pool.free(x)
    assert list(pool._evictable) == [*reversed(y_blocks), *reversed(x_blocks)]
    taken = BlockTable()
    assert pool.allocate(taken, 4)  # evicts y's tail
    assert pool.match_prefix(list(range(200, 212))).num_cached_tokens == 8
    assert pool.allocate(taken, 4)  # y's middle
    assert pool.match_prefix(list(range(200, 212))).num_cached_tokens == 4
    assert pool.match_prefix(list(range(100, 112))).num_cached_tokens == 12
    assert pool.allocate(taken, 4)  # y's head
    assert pool.match_prefix(list(range(200, 212))).num_cached_tokens == 0
    assert pool.allocate(taken, 4)  # then x, tail first
    assert pool.match_prefix(list(range(100, 112))).num_cached_tokens == 8
    pool.check([taken])


def test_reusing_a_cached_block_refreshes_it():
    pool = BlockPool(4, BS)
    x, _ = admit(pool, [1, 2, 3, 4, 0])
    y, _ = admit(pool, [5, 6, 7, 8, 0])
    pool.free(x)
    pool.free(y)
    z, cached = admit(pool, [1, 2, 3, 4, 9])  # x's block, in use again, then freed last
    assert cached == 4
    pool.free(z)
    filler = BlockTable()
    assert pool.allocate(filler, 3 * BS)  # 2 plain free + the least recently freed cached: y's
    assert pool.match_prefix([5, 6, 7, 8, 0]).num_cached_tokens == 0
    assert pool.match_prefix([1, 2, 3, 4, 0]).num_cached_tokens == 4
    pool.check([filler])


def test_an_evicted_block_loses_its_hash():
    pool = BlockPool(2, BS)
    a, _ = admit(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.free(a)
    b = BlockTable()
    assert pool.allocate(b, 8)
    assert pool.num_cached_blocks == 0
    hits = pool.prefix_cache_hits
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == PrefixMatch((), 0)
    assert pool.prefix_cache_hits == hits
    pool.check([b])


# ---- fork --------------------------------------------------------------------------------------------


def test_fork_shares_full_blocks_and_copies_the_partial_tail():
    pool = BlockPool(8, BS)
    parent, _ = admit(pool, list(range(10)))  # 2 full blocks + 2 tokens
    forked = pool.fork(parent)
    assert forked is not None
    child, copies = forked
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    assert copies == [(parent.blocks[2], child.blocks[2])]
    assert child.num_tokens == 10 and child.block_hashes == parent.block_hashes
    assert [pool._ref[b] for b in parent.blocks] == [2, 2, 1]
    pool.check([parent, child])
    # each sibling decodes into its own tail
    assert pool.allocate(parent, 1) and pool.allocate(child, 1)
    pool.free(parent)
    pool.check([child])
    pool.free(child)
    pool.check([])
    assert pool.num_free_blocks == 8


def test_fork_of_full_blocks_only_copies_nothing():
    pool = BlockPool(2, BS)
    parent, _ = admit(pool, list(range(8)))
    forked = pool.fork(parent)
    assert forked is not None and forked[1] == [] and forked[0].blocks == parent.blocks
    pool.check([parent, forked[0]])


def test_fork_fails_when_no_block_is_free():
    pool = BlockPool(2, BS)
    parent, _ = admit(pool, list(range(6)))
    assert pool.num_free_blocks == 0
    assert pool.fork(parent) is None
    pool.check([parent])


# ---- reset and prefix caching off --------------------------------------------------------------------


def test_reset_prefix_cache():
    pool = BlockPool(8, BS)
    a, _ = admit(pool, list(range(9)))
    assert not pool.reset_prefix_cache()  # refused while a block is in use
    assert pool.num_cached_blocks == 2
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.num_evictable_blocks == 0 and pool.num_free_blocks == 8
    assert pool.match_prefix(list(range(9))).num_cached_tokens == 0
    pool.check([])


def test_prefix_caching_off():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    a, _ = admit(pool, list(range(9)))
    b, cached = admit(pool, list(range(9)))
    assert cached == 0 and not set(a.blocks) & set(b.blocks)
    assert pool.num_cached_blocks == 0 and pool.prefix_cache_queries == 0
    forked = pool.fork(a)
    assert forked is not None  # forks still share full blocks
    assert forked[0].blocks[:2] == a.blocks[:2]
    pool.check([a, b, forked[0]])


# ---- random sequences of operations ------------------------------------------------------------------


class _Request:
    def __init__(self, tokens: list[int], salt: str | None, table: BlockTable, computed: int) -> None:
        self.tokens = tokens
        self.salt = salt
        self.table = table
        self.computed = computed  # tokens whose KV is written


class PoolMachine(RuleBasedStateMachine):
    """A scheduler and a runner in miniature. The runner's "KV" is modelled per block as the salt and
    the token prefix written into it; a block that a lookup returns must hold exactly the prefix asked
    for, and no block is written while another table shares it."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, 2)
        self.live: list[_Request] = []
        self.content: dict[int, tuple[str | None, tuple[int, ...]]] = {}

    def write(self, request: _Request, upto: int) -> None:
        """The runner computes the request's tokens [computed, upto) into its blocks."""
        bs = self.pool.block_size
        for i in range(request.computed // bs, -(-upto // bs)):
            block = request.table.blocks[i]
            assert self.pool._ref[block] == 1, "a shared block is written"
            self.content[block] = (request.salt, tuple(request.tokens[: min(upto, (i + 1) * bs)]))
        request.computed = upto

    @rule(
        target=requests,
        head=st.sampled_from([(), (0, 1, 0, 1), (0, 1, 0, 1, 2, 2), (1,) * 8]),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=8),
        salt=st.sampled_from([None, None, "t"]),
    )
    def admit(self, head, tail, salt):
        tokens = [*head, *tail]  # shared heads make hits likely, random tails make misses
        bs = self.pool.block_size
        blocks, cached = self.pool.match_prefix(tokens, salt, max_tokens=len(tokens) - 1)
        assert cached == len(blocks) * bs < len(tokens)
        for i, block in enumerate(blocks):
            assert self.content[block] == (salt, tuple(tokens[: (i + 1) * bs])), "a lookup found other KV"
        before = (self.pool.num_free_blocks, self.pool.num_evictable_blocks, self.pool.prefix_cache_hits)
        table = BlockTable()
        if not self.pool.allocate(table, len(tokens) - cached, blocks):
            assert table == BlockTable()
            assert (self.pool.num_free_blocks, self.pool.num_evictable_blocks) == before[:2]
            return multiple()  # nothing joins the bundle
        request = _Request(list(tokens), salt, table, cached)
        self.live.append(request)
        return request

    @rule(request=requests, k=st.integers(1, 6))
    def compute(self, request, k):
        if request not in self.live:
            return
        self.write(request, min(request.table.num_tokens, request.computed + k))
        self.pool.cache_full_blocks(request.table, request.tokens[: request.computed], request.salt)

    @rule(request=requests, new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, request, new):
        if request not in self.live or request.computed < request.table.num_tokens:
            return
        before = (list(request.table.blocks), request.table.num_tokens, self.pool.num_free_blocks)
        if self.pool.allocate(request.table, len(new)):
            request.tokens.extend(new)
        else:
            assert (request.table.blocks, request.table.num_tokens, self.pool.num_free_blocks) == before

    @rule(target=requests, request=requests)
    def fork(self, request):
        if request not in self.live or request.computed < request.table.num_tokens:
            return multiple()
        forked = self.pool.fork(request.table)
        if forked is None:
            assert self.pool.num_free_blocks == 0
            return multiple()
        table, copies = forked
        for src, dst in copies:
            self.content[dst] = self.content[src]
        child = _Request(list(request.tokens), request.salt, table, request.computed)
        self.live.append(child)
        return child

    @rule(request=consumes(requests))
    def free(self, request):
        if request not in self.live:
            return
        self.pool.free(request.table)
        self.live.remove(request)

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        assert self.pool.reset_prefix_cache()
        assert self.pool.num_cached_blocks == 0

    @rule()
    def reset_refused_while_in_use(self):
        if self.live:
            cached = self.pool.num_cached_blocks
            assert not self.pool.reset_prefix_cache()
            assert self.pool.num_cached_blocks == cached

    @invariant()
    def consistent(self):
        self.pool.check([r.table for r in self.live])
        assert self.pool.usage() == self.pool.num_used_blocks / self.pool.num_blocks


PoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pool_state_machine = PoolMachine.TestCase
