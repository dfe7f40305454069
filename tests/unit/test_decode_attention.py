"""The compiled CPU attention's shared parts (engine/attention/cpu_kernel.py): the row softmax the paged kernels
inline, and where they apply. The paged kernels themselves: tests/unit/test_paged_attention.py."""

from __future__ import annotations

import numpy as np
import torch

from lmiserve.engine.attention import cpu_kernel as decode_attention


def test_the_row_softmax_is_torchs_and_stays_finite_for_extreme_scores():
    """Each row in place, its maximum subtracted first: large scores neither overflow nor give NaN."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 17)).astype(np.float32)
    scores[1] *= 100.0
    scores[2] = 1e4
    expected = torch.from_numpy(scores.copy()).softmax(-1)
    decode_attention.softmax_rows(scores)
    assert np.isfinite(scores).all()
    torch.testing.assert_close(torch.from_numpy(scores), expected, rtol=1e-5, atol=1e-6)


def test_it_serves_fp32_cpu_models_only():
    assert decode_attention.available(torch.float32, torch.device("cpu"))
    assert not decode_attention.available(torch.bfloat16, torch.device("cpu"))
    assert not decode_attention.available(torch.float32, torch.device("cuda"))
