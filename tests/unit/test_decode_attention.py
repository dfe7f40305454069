"""The compiled CPU attention's shared parts (engine/attention/cpu_kernel.py): the row softmax the paged kernels
inline, and where they apply. The paged kernels themselves: tests/unit/test_paged_attention.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from lmiserve.engine.attention import cpu_kernel as decode_attention
from lmiserve.engine.attention import cpu_kernel_loops


def test_the_row_softmax_is_torchs_and_stays_finite_for_extreme_scores():
    """Each row in place, its maximum subtracted first: large scores neither overflow nor give NaN."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 17)).astype(np.float32)
    scores[1] *= 100.0
    scores[2] = 1e4
    expected = torch.from_numpy(scores.copy()).softmax(-1)
    cpu_kernel_loops.softmax_rows(scores)
    assert np.isfinite(scores).all()
    torch.testing.assert_close(torch.from_numpy(scores), expected, rtol=1e-5, atol=1e-6)


def test_it_serves_fp32_and_bf16_cpu_caches_only():
    assert decode_attention.available(torch.float32, torch.device("cpu"))
    assert decode_attention.available(torch.bfloat16, torch.device("cpu"))
    assert not decode_attention.available(torch.float16, torch.device("cpu"))
    assert decode_attention.available(torch.float8_e4m3fn, torch.device("cpu"))
    assert decode_attention.available(torch.float8_e5m2, torch.device("cpu"))
    assert not decode_attention.available(torch.float32, torch.device("cuda"))


def widen_all(values: np.ndarray) -> np.ndarray:
    """Each of `values` through the kernels' `widened`, compiled (for the values' numpy type)."""
    return _widen_all()(values)


@functools.cache
def _widen_all():  # type: ignore[no-untyped-def]
    @cpu_kernel_loops.numba.njit
    def widen(values):  # type: ignore[no-untyped-def]
        out = np.empty(values.shape, dtype=np.float32)
        for i in range(values.shape[0]):
            out[i] = cpu_kernel_loops.widened(values[i])
        return out

    return widen


def test_a_bf16_caches_bits_widen_to_torchs_fp32_for_every_pattern():
    """All 65,536 bf16 bit patterns, read as the kernels read a bf16 cache: torch's widening, bit for bit
    (NaNs as NaNs), and an fp32 value through unchanged."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)

    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    got = torch.from_numpy(widen_all(bits))
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int32), expected[~expected.isnan()].view(torch.int32))
    floats = np.array([1.5, -0.0, 3e-39], dtype=np.float32)
    assert np.array_equal(widen_all(floats).view(np.int32), floats.view(np.int32))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_caches_bytes_widen_to_torchs_fp32_for_every_byte(fp8):
    """All 256 bytes of each fp8 format, read as the kernels read an fp8 cache (`bits`: e4m3 as uint8, e5m2 as
    int8): torch's conversion, bit for bit (NaNs as NaNs, the infinities of e5m2 as infinities)."""

    cache = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    expected = cache.float()
    got = torch.from_numpy(widen_all(decode_attention.bits(cache)))
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int32), expected[~expected.isnan()].view(torch.int32))
