"""The compiled CPU decode attention (engine/decode_attention.py) against plain torch attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmiserve.engine import decode_attention


def _reference(query, keys, values, spans, scale):
    """Each row's query heads (GQA: `groups` per kv head) over its own positions, with torch ops."""
    outputs = []
    for row, span in enumerate(spans):
        scores = torch.einsum("hgd,hsd->hgs", query[row], keys[row, :, :span]) * scale
        outputs.append(torch.einsum("hgs,hsd->hgd", scores.softmax(-1), values[row, :, :span]))
    return torch.stack(outputs)


@pytest.mark.parametrize("kv_heads,groups", [(3, 3), (2, 1), (1, 4)])
def test_each_row_attends_over_its_own_length_after_writing_its_new_key_and_value(kv_heads: int, groups: int):
    rng = torch.Generator().manual_seed(0)
    rows, capacity, dim = 6, 40, 16
    spans = np.array([1, 7, 40, 3, 22, 9])
    keys = torch.randn(rows + 2, kv_heads, capacity, dim, generator=rng)  # more slots than rows
    values = torch.randn(rows + 2, kv_heads, capacity, dim, generator=rng)
    new_k = torch.randn(rows, kv_heads, dim, generator=rng)
    new_v = torch.randn(rows, kv_heads, dim, generator=rng)
    query = torch.randn(rows, kv_heads, groups, dim, generator=rng)
    expected_keys, expected_values = keys.clone(), values.clone()
    for row, span in enumerate(spans):
        expected_keys[row, :, span - 1] = new_k[row]
        expected_values[row, :, span - 1] = new_v[row]
    untouched = keys[rows:].clone()

    out = decode_attention.decode_attention(query, keys, values, new_k, new_v, spans, 0.25)

    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(keys[rows:], untouched)
    torch.testing.assert_close(
        out, _reference(query, expected_keys, expected_values, spans, 0.25), rtol=1e-5, atol=1e-6
    )


def test_extreme_scores_stay_finite():
    """Softmax subtracts each row's maximum: large logits neither overflow nor give NaN."""
    query = torch.full((1, 1, 2, 8), 40.0)
    keys = torch.full((1, 1, 4, 8), 40.0)
    values = torch.arange(32, dtype=torch.float32).reshape(1, 1, 4, 8)
    out = decode_attention.decode_attention(query, keys, values, keys[:, :, 0], values[:, :, 0], np.array([4]), 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0, 0], values[0, 0].mean(0))


def test_it_serves_fp32_cpu_models_only():
    assert decode_attention.available(torch.float32, torch.device("cpu"))
    assert not decode_attention.available(torch.bfloat16, torch.device("cpu"))
    assert not decode_attention.available(torch.float32, torch.device("cuda"))
