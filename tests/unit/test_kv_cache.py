"""SlotKVCache: where update() writes in decode and prefill modes, what it returns, growth, slot moves."""

from __future__ import annotations

import pytest
import torch

from lmiserve.engine.kv_cache import SlotKVCache

LAYERS, SLOTS, HEADS, DIM = 2, 4, 2, 3


def make_cache(initial_len: int = 8, max_len: int | None = None) -> SlotKVCache:
    return SlotKVCache(LAYERS, SLOTS, HEADS, DIM, torch.float32, torch.device("cpu"), initial_len, max_len)


def states(batch: int, length: int, base: float) -> torch.Tensor:
    numel = batch * HEADS * length * DIM
    return (torch.arange(numel, dtype=torch.float32) + base).reshape(batch, HEADS, length, DIM)


def test_shapes_and_zero_init():
    cache = make_cache()
    assert cache.capacity == 8 and len(cache) == LAYERS
    assert all(k.shape == (SLOTS, HEADS, 8, DIM) and not k.any() for k in cache.keys + cache.values)


def test_update_without_mode_raises():
    with pytest.raises(RuntimeError):
        make_cache().update(states(1, 1, 0), states(1, 1, 0), 0)


def test_prefill_writes_the_slot_range_and_returns_that_slot_up_to_the_end():
    cache = make_cache()
    cache.for_prefill(slot=2, start=3, length=4)
    assert cache.get_seq_length() == 7
    k, v = states(1, 4, 1.0), states(1, 4, 1000.0)
    ret_k, ret_v = cache.update(k, v, layer_idx=1)
    assert ret_k.shape == (1, HEADS, 7, DIM) and ret_v.shape == (1, HEADS, 7, DIM)
    torch.testing.assert_close(cache.keys[1][2, :, 3:7], k[0])
    torch.testing.assert_close(cache.values[1][2, :, 3:7], v[0])
    torch.testing.assert_close(ret_k[0, :, 3:7], k[0])
    assert not ret_k[0, :, :3].any()
    # nothing else written: other slots, other positions, other layers
    mask = torch.ones(SLOTS, HEADS, 8, DIM, dtype=torch.bool)
    mask[2, :, 3:7] = False
    assert not cache.keys[1][mask].any() and not cache.values[1][mask].any()
    assert not cache.keys[0].any() and not cache.values[0].any()
    # the returned tensors are views of the cache (no copy)
    assert ret_k.data_ptr() == cache.keys[1][2].data_ptr()


def test_decode_writes_one_position_per_row_and_returns_rows_up_to_the_longest():
    cache = make_cache()
    positions = torch.tensor([2, 5, 0])
    cache.for_decode(positions)
    assert cache.get_seq_length() == 6
    k, v = states(3, 1, 1.0), states(3, 1, 500.0)
    ret_k, ret_v = cache.update(k, v, layer_idx=0)
    assert ret_k.shape == (3, HEADS, 6, DIM) and ret_v.shape == (3, HEADS, 6, DIM)
    for row, pos in enumerate(positions.tolist()):
        torch.testing.assert_close(cache.keys[0][row, :, pos], k[row, :, 0])
        torch.testing.assert_close(cache.values[0][row, :, pos], v[row, :, 0])
        torch.testing.assert_close(ret_k[row, :, pos], k[row, :, 0])
    written = cache.keys[0].abs().sum(dim=(1, 3)) > 0  # [slot, position]
    assert written.nonzero().tolist() == [[0, 2], [1, 5], [2, 0]]
    assert not cache.keys[0][3].any()  # the slot beyond the rows is untouched
    assert ret_k.data_ptr() == cache.keys[0].data_ptr()


def test_decode_after_prefill_sees_both():
    cache = make_cache()
    cache.for_prefill(0, 0, 3)
    for layer in range(LAYERS):
        cache.update(states(1, 3, 1.0), states(1, 3, 1.0), layer)
    cache.for_decode(torch.tensor([3]))
    for layer in range(LAYERS):
        ret_k, _ = cache.update(states(1, 1, 100.0), states(1, 1, 100.0), layer)
    assert ret_k.shape == (1, HEADS, 4, DIM)
    torch.testing.assert_close(ret_k[0, :, :3], states(1, 3, 1.0)[0])
    torch.testing.assert_close(ret_k[0, :, 3], states(1, 1, 100.0)[0, :, 0])


def test_ensure_capacity_doubles_and_preserves_content():
    cache = make_cache(initial_len=4)
    cache.for_prefill(1, 0, 4)
    cache.update(states(1, 4, 1.0), states(1, 4, 2.0), 0)
    before_k, before_v = cache.keys[0].clone(), cache.values[0].clone()
    cache.ensure_capacity(4)
    assert cache.capacity == 4
    cache.ensure_capacity(9)
    assert cache.capacity == 16
    for store in (cache.keys, cache.values):
        assert all(t.shape == (SLOTS, HEADS, 16, DIM) for t in store)
    torch.testing.assert_close(cache.keys[0][:, :, :4], before_k)
    torch.testing.assert_close(cache.values[0][:, :, :4], before_v)
    assert not cache.keys[0][:, :, 4:].any()


def test_ensure_capacity_is_capped_at_max_len_but_fits_the_request():
    cache = make_cache(initial_len=4, max_len=10)
    cache.ensure_capacity(9)
    assert cache.capacity == 10  # not 16
    cache.ensure_capacity(10)
    assert cache.capacity == 10


def test_for_prefill_and_for_decode_grow_the_cache():
    cache = make_cache(initial_len=4)
    cache.for_prefill(0, 2, 5)
    assert cache.capacity == 8
    cache.update(states(1, 5, 1.0), states(1, 5, 1.0), 0)
    torch.testing.assert_close(cache.keys[0][0, :, 2:7], states(1, 5, 1.0)[0])
    cache.for_decode(torch.tensor([7, 12]))
    assert cache.capacity == 16
    ret_k, _ = cache.update(states(2, 1, 50.0), states(2, 1, 50.0), 0)
    assert ret_k.shape == (2, HEADS, 13, DIM)
    torch.testing.assert_close(ret_k[0, :, 2:7], states(1, 5, 1.0)[0])  # earlier writes survived growth


def test_move_slot_copies_a_prefix_in_every_layer():
    cache = make_cache()
    for layer in range(LAYERS):
        for slot in range(SLOTS):
            cache.keys[layer][slot] = slot + 1 + 10 * layer
            cache.values[layer][slot] = -(slot + 1 + 10 * layer)
    cache.move_slot(3, 1, 5)
    for layer in range(LAYERS):
        assert (cache.keys[layer][1, :, :5] == 4 + 10 * layer).all()
        assert (cache.values[layer][1, :, :5] == -(4 + 10 * layer)).all()
        assert (cache.keys[layer][1, :, 5:] == 2 + 10 * layer).all()  # beyond `length`: untouched
        assert (cache.keys[layer][3] == 4 + 10 * layer).all()  # source unchanged
        assert (cache.keys[layer][0] == 1 + 10 * layer).all() and (cache.keys[layer][2] == 3 + 10 * layer).all()


def test_move_slot_noops():
    cache = make_cache()
    cache.keys[0][2] = 7.0
    snapshot = [t.clone() for t in cache.keys + cache.values]
    cache.move_slot(2, 2, 8)
    cache.move_slot(2, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.keys + cache.values))
