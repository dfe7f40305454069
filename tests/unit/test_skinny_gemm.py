"""The compiled few-row product kernel (engine/model/skinny_gemm.py) and its routing in `CpuGemm`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmiserve.engine.model import skinny_gemm
from lmiserve.engine.model.cpu_gemm import CpuGemm

pytestmark = pytest.mark.skipif(
    not skinny_gemm.available(torch.float32, torch.device("cpu")), reason="numba is not usable here"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize(("out", "inner"), [(96, 64), (7, 33), (1, 576), (130, 1)])
def test_kernel_computes_x_times_w_transposed(rows: int, out: int, inner: int):
    x, weight = torch.randn(rows, inner), torch.randn(out, inner)
    y = skinny_gemm.linear(x, weight)
    assert y.shape == (rows, out) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_kernel_takes_views():
    """A transposed view (what a transposed BLAS product returns) and a slice of rows are copied first."""
    x, weight = torch.randn(64, 5).t(), torch.randn(40, 64)[::2]
    torch.testing.assert_close(skinny_gemm.linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("few_rows", [0, 4, 9])
def test_few_rows_route_and_padding(few_rows: int, monkeypatch):
    """Products of 2..few_rows rows go through the kernel, unpadded; others as before."""
    gemm = CpuGemm.tuned_default(2).with_(few_rows=few_rows)
    calls = []
    real = skinny_gemm.linear
    monkeypatch.setattr(skinny_gemm, "linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    weight, bias = torch.randn(100, 32), torch.randn(100)
    for rows in range(1, 12):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(gemm.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        padded = 0 if rows <= few_rows or rows < 5 else (-rows) % 8
        assert gemm.row_padding(rows) == padded
    assert calls == list(range(2, few_rows + 1))
    # other dtypes never take it
    calls.clear()
    gemm.linear(torch.randn(3, 32, dtype=torch.bfloat16), weight.bfloat16(), None)
    assert calls == []
