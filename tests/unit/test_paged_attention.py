"""Attention over the block KV cache (engine/attention/paged.py) against plain contiguous attention."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from lmiserve.engine.attention import cpu_kernel
from lmiserve.engine.attention import paged as paged_attention
from lmiserve.engine.attention.paged import PagedKVCache

DIM = 16


def _layout(spans: list[int], block_size: int, spare: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables for rows of these spans, their blocks scattered at random in a pool with `spare`
    unused blocks; padded with block 0 (plus one padding column) like a runner's table."""
    needed = [-(-s // block_size) for s in spans]
    num_blocks = sum(needed) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 1
    tables = torch.zeros(len(spans), width, dtype=torch.int64)
    taken = 0
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(order[taken : taken + count])
        taken += count
    return tables, num_blocks


def _contiguous(cache: torch.Tensor, table: torch.Tensor, span: int) -> torch.Tensor:
    """Positions ``0..span-1`` of one row as ``[kv_heads, span, head_dim]``, read one position at a time."""
    block_size = cache.shape[2]
    return torch.stack([cache[int(table[p // block_size]), :, p % block_size] for p in range(span)], dim=1)


def _reference(query, key_cache, value_cache, tables, spans, scale):
    """Each row's query heads (GQA: `groups` per kv head) over its own positions, in fp32 with torch ops."""
    outputs = []
    for row, span in enumerate(spans):
        keys = _contiguous(key_cache, tables[row], span).float()
        values = _contiguous(value_cache, tables[row], span).float()
        scores = torch.einsum("hgd,hsd->hgs", query[row].float(), keys) * scale
        outputs.append(torch.einsum("hgs,hsd->hgd", scores.softmax(-1), values))
    return torch.stack(outputs)


def _torch_with_step_index(query, key_cache, value_cache, new_keys, new_values, tables, spans, scale):
    """The torch path given the step's `decode_index` (built once a step, shared by every layer)."""
    index = paged_attention.decode_index(tables, spans, key_cache.shape[2], key_cache.device)
    return paged_attention.torch_decode_attention(
        query, key_cache, value_cache, new_keys, new_values, tables, spans, scale, index
    )


IMPLEMENTATIONS = {
    "compiled": (cpu_kernel.compiled_decode_attention, torch.float32, 1e-5),
    # tasks of whole rows, and of a split of each row's kv heads (3 heads: 1 + 2)
    "compiled-rows": (functools.partial(cpu_kernel.compiled_decode_attention, parts=1), torch.float32, 1e-5),
    "compiled-split": (functools.partial(cpu_kernel.compiled_decode_attention, parts=2), torch.float32, 1e-5),
    # a bf16 cache read as its bits, widened exactly: fp32 arithmetic, the output rounded to bf16 once
    "compiled-bf16": (cpu_kernel.compiled_decode_attention, torch.bfloat16, 8e-3),
    "compiled-bf16-rows": (functools.partial(cpu_kernel.compiled_decode_attention, parts=1), torch.bfloat16, 8e-3),
    "torch-fp32": (paged_attention.torch_decode_attention, torch.float32, 1e-5),
    "torch-bf16": (paged_attention.torch_decode_attention, torch.bfloat16, 2e-2),
    "torch-step-index": (_torch_with_step_index, torch.float32, 1e-5),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("kv_heads,groups", [(3, 3), (2, 1)])
def test_decode_writes_each_rows_new_key_and_value_then_attends_over_its_own_positions(
    impl: str, block_size: int, kv_heads: int, groups: int
):
    fn, dtype, tol = IMPLEMENTATIONS[impl]
    gen = torch.Generator().manual_seed(block_size * 10 + groups)
    # a span of 1, spans ending exactly on a block boundary, and others in between
    spans = [1, block_size, 37, 2 * block_size, 5, 3 * block_size + 1]
    tables, num_blocks = _layout(spans, block_size, spare=5, gen=gen)
    shape = (num_blocks, kv_heads, block_size, DIM)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    rows = len(spans)
    new_k = torch.randn(rows, kv_heads, DIM, generator=gen).to(dtype)
    new_v = torch.randn(rows, kv_heads, DIM, generator=gen).to(dtype)
    query = torch.randn(rows, kv_heads, groups, DIM, generator=gen).to(dtype)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    for row, span in enumerate(spans):
        block, offset = int(tables[row, (span - 1) // block_size]), (span - 1) % block_size
        expected_keys[block, :, offset] = new_k[row]
        expected_values[block, :, offset] = new_v[row]

    out = fn(query, key_cache, value_cache, new_k, new_v, tables, np.array(spans), 0.25)

    # the new keys/values landed in their block and offset, and nothing else in the pool changed
    assert torch.equal(key_cache, expected_keys) and torch.equal(value_cache, expected_values)
    assert out.shape == query.shape and out.dtype == dtype
    expected = _reference(query, expected_keys, expected_values, tables, spans, 0.25)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


def test_the_dispatcher_picks_the_kernel_for_fp32_bf16_and_fp8_cpu_caches_and_torch_otherwise(
    monkeypatch: pytest.MonkeyPatch,
):
    calls: list[str] = []
    monkeypatch.setattr(cpu_kernel, "compiled_decode_attention", lambda *a, **k: calls.append("compiled"))
    monkeypatch.setattr(paged_attention, "torch_decode_attention", lambda *a, **k: calls.append("torch"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.zeros(1, 1, 4, DIM, dtype=dtype)
        paged_attention.paged_decode_attention(cache, cache, cache, cache, cache, cache, [1], 1.0)
    assert calls == ["compiled", "compiled", "torch", "compiled", "compiled"]
    assert cpu_kernel.available(torch.float32, torch.device("cpu"))
    assert cpu_kernel.available(torch.bfloat16, torch.device("cpu"))
    assert not cpu_kernel.available(torch.float16, torch.device("cpu"))
    assert not cpu_kernel.available(torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("impl", ["compiled", "compiled-bf16", "torch-fp32"])
def test_extreme_scores_stay_finite(impl: str):
    fn, dtype, _ = IMPLEMENTATIONS[impl]
    query = torch.full((1, 1, 2, 8), 40.0, dtype=dtype)
    keys = torch.full((2, 1, 2, 8), 40.0, dtype=dtype)
    values = torch.arange(32, dtype=dtype).reshape(2, 1, 2, 8)  # (integers, exact in bf16)
    tables = torch.tensor([[1, 0]])
    new_k, new_v = keys[1:, :, 0].clone(), values[1:, :, 0].clone()
    out = fn(query, keys, values, new_k, new_v, tables, np.array([4]), 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0, 0], values[[1, 0]].transpose(0, 1).reshape(4, 8).mean(0))


def test_no_rows_is_an_empty_result():
    cache = torch.zeros(2, 1, 4, DIM, dtype=torch.bfloat16)
    query = torch.zeros(0, 1, 1, DIM, dtype=torch.bfloat16)
    new = torch.zeros(0, 1, DIM, dtype=torch.bfloat16)
    tables = torch.zeros(0, 1, dtype=torch.int64)
    out = paged_attention.torch_decode_attention(query, cache, cache, new, new, tables, np.array([], int), 1.0)
    assert out.shape == (0, 1, 1, DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4])
def test_chunks_written_then_gathered_round_trip(block_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, total = 3, 3 * block_size + 2
    table = torch.randperm(8, generator=gen)[: -(-total // block_size)]
    key_cache = torch.randn(8, kv_heads, block_size, DIM, generator=gen).to(dtype)
    value_cache = torch.randn(8, kv_heads, block_size, DIM, generator=gen).to(dtype)
    keys = torch.randn(total, kv_heads, DIM, generator=gen).to(dtype)
    values = torch.randn(total, kv_heads, DIM, generator=gen).to(dtype)
    outside = [b for b in range(8) if b not in table.tolist()]
    untouched = key_cache[outside].clone(), value_cache[outside].clone()
    # chunks that start and end mid-block, on a boundary, and an empty one
    cuts = [0, 3, block_size, block_size, 2 * block_size + 1, total]
    for start, end in itertools.pairwise(cuts):
        paged_attention.write_chunk(key_cache, value_cache, keys[start:end], values[start:end], table, start)
        got_k, got_v = paged_attention.gather_context(key_cache, value_cache, table, end)
        assert got_k.shape == (kv_heads, end, DIM)
        assert torch.equal(got_k, keys[:end].transpose(0, 1)) and torch.equal(got_v, values[:end].transpose(0, 1))
    assert torch.equal(key_cache[outside], untouched[0]) and torch.equal(value_cache[outside], untouched[1])


def test_a_chunk_then_decode_steps_read_the_same_cache():
    """Prefill writes through `write_chunk`; decode (compiled) then sees those positions."""
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, 6, 4, 2, DIM, torch.float32, "cpu")
    cache.ensure_zeroed(5)
    table = torch.tensor([4, 1, 3])
    keys = torch.randn(9, 2, DIM, generator=gen)
    values = torch.randn(9, 2, DIM, generator=gen)
    paged_attention.write_chunk(cache.keys[0], cache.values[0], keys[:8], values[:8], table, 0)
    query = torch.randn(1, 2, 3, DIM, generator=gen)
    out = paged_attention.paged_decode_attention(
        query, cache.keys[0], cache.values[0], keys[8:], values[8:], table[None], np.array([9]), 0.5
    )
    scores = torch.einsum("hgd,shd->hgs", query[0], keys) * 0.5
    torch.testing.assert_close(out[0], torch.einsum("hgs,shd->hgd", scores.softmax(-1), values))


def test_the_cache_layout_and_size():
    cache = PagedKVCache(3, 10, 16, 2, 8, torch.bfloat16, "cpu")
    assert len(cache.keys) == len(cache.values) == 3
    for tensor in (*cache.keys, *cache.values):
        assert tensor.shape == (10, 2, 16, 8) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    per_block = PagedKVCache.bytes_per_block(3, 16, 2, 8, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 8 * 2
    assert cache.nbytes == 10 * per_block == sum(t.nbytes for t in (*cache.keys, *cache.values))


def test_copy_blocks_copies_every_layer_k_and_v_and_nothing_else():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(2, 6, 4, 2, DIM, torch.float32, "cpu")
    cache.ensure_zeroed(6)
    for tensor in (*cache.keys, *cache.values):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    cache.copy_blocks([(1, 4), (2, 5), (4, 0)])  # 4 is read before it is overwritten
    for old, new in zip(before, (*cache.keys, *cache.values), strict=True):
        assert torch.equal(new[4], old[1]) and torch.equal(new[5], old[2]) and torch.equal(new[0], old[4])
        assert torch.equal(new[[1, 2, 3]], old[[1, 2, 3]])
    cache.copy_blocks([])


def test_blocks_are_zeroed_on_demand_once():
    cache = PagedKVCache(2, 8, 4, 2, DIM, torch.bfloat16, "cpu")
    cache.ensure_zeroed(3)
    assert cache.zeroed_blocks == 3
    assert all(not t[:3].any() for t in (*cache.keys, *cache.values))
    cache.keys[1][2].fill_(1.0)
    cache.ensure_zeroed(2)
    cache.ensure_zeroed(5)  # what is below the mark stays
    assert cache.zeroed_blocks == 5 and bool((cache.keys[1][2] == 1).all()) and not cache.keys[1][3:5].any()
    cache.copy_blocks([(2, 6)])  # the destination counts as used: zeroing up to it first, not after
    cache.ensure_zeroed(8)
    assert bool((cache.keys[1][6] == 1).all()) and not cache.keys[1][7].any()
    with pytest.raises(ValueError, match="past the pool"):
        cache.ensure_zeroed(9)
