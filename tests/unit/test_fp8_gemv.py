"""`fp8_gemv` (issue #39): the weight-only fp8 Triton kernel for decode rows, and the choice between it and
``torch._scaled_mm``, run on CPU tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
on a CPU). On a GPU the GPU check runs the engine's fp8 tests (test_quantized_checkpoints.py) and times the
kernel (benchmarks/quantized_kernels.py)."""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fp8_ops import dequantize_fp8, fp8_linear, quantize_fp8, scaled_product

pytestmark = pytest.mark.skipif(
    not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_gemv, "_chosen", {})


def fp8_weight(out: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    q, scale = quantize_fp8(torch.randn(out, inputs) * 0.05)
    return q, scale, dequantize_fp8(q, scale)


@pytest.mark.parametrize(
    "config",
    [
        fp8_gemv.Config(False, 1, 16, 32),  # one row a tile: products and sums
        fp8_gemv.Config(False, 4, 32, 64),
        fp8_gemv.Config(True, 16, 16, 32),  # tensor-core tiles
    ],
    ids=str,
)
@pytest.mark.parametrize("inputs", [96, 100], ids=["k-even", "k-ragged"])
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
def test_the_kernel_computes_the_dequantized_product(config: fp8_gemv.Config, inputs: int, rows: int) -> None:
    """Outputs not a multiple of the tile (40), inputs a multiple of it or not, rows in one tile or several:
    fp32 activations give fp32's product of the de-quantized weight."""
    weight, scale, dense = fp8_weight(40, inputs)
    x = torch.randn(rows, inputs)
    got = fp8_gemv.fp8_gemv(x, weight, scale, config)
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_come_back_in_their_dtype_within_its_rounding(dtype: torch.dtype) -> None:
    """A bf16 or fp16 model's rows (the GPU's case) on the per-row tiles; the tensor-core tile in fp16 (the
    interpreter's dot has no bf16: the self-check of `choose` is what catches such a kernel)."""
    weight, scale, dense = fp8_weight(48, 64, seed=1)
    x = torch.randn(2, 64).to(dtype)
    configs = [fp8_gemv.Config(False, 4, 16, 32)] + (
        [fp8_gemv.Config(True, 16, 16, 32)] if dtype == torch.float16 else []
    )
    want = x.float() @ dense.t()
    for config in configs:
        got = fp8_gemv.fp8_gemv(x, weight, scale, config)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_a_non_contiguous_row_view_reads_the_right_rows() -> None:
    """The fused projections hand slices of wider activations."""
    weight, scale, dense = fp8_weight(32, 64, seed=2)
    wide = torch.randn(3, 128)
    x = wide[:, 32:96]
    got = fp8_gemv.fp8_gemv(x, weight, scale, fp8_gemv.Config(False, 1, 16, 32))
    torch.testing.assert_close(got, x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_choose_measures_once_per_shape_and_bucket_and_fp8_linear_runs_its_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:2] for b, configs in fp8_gemv.CANDIDATES.items()})
    weight, scale, dense = fp8_weight(48, 64, seed=3)
    calls: list[int] = []

    def product(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return scaled_product(x, weight, scale)

    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    x = torch.randn(3, 64)
    first = fp8_gemv.choose(x, weight, scale, product)
    assert calls, "the _scaled_mm product was timed against the kernel"
    assert "fp8 products [48 x 64] at 4 row(s)" in caplog.text
    measured = len(calls)
    assert fp8_gemv.choose(torch.randn(2, 64), weight, scale, product) == first  # 2-4 rows: the same bucket
    assert len(calls) == measured
    fp8_gemv.choose(torch.randn(1, 64), weight, scale, product)  # another bucket: measured
    assert len(calls) > measured
    assert set(fp8_gemv.chosen()) == {
        (torch.device("cpu"), 48, 64, 4, torch.float32),
        (torch.device("cpu"), 48, 64, 1, torch.float32),
    }
    # fp8_linear takes the choice: the kernel (fp32 exact) or the _scaled_mm product (fp8 activations)
    fp8_gemv._chosen[(torch.device("cpu"), 48, 64, 4, torch.float32)] = fp8_gemv.Config(False, 4, 16, 32)
    torch.testing.assert_close(fp8_linear(x, weight, scale), x @ dense.t(), rtol=1e-5, atol=1e-5)
    fp8_gemv._chosen[(torch.device("cpu"), 48, 64, 4, torch.float32)] = None
    torch.testing.assert_close(fp8_linear(x, weight, scale), scaled_product(x, weight, scale))


def test_more_rows_than_max_rows_and_cpu_tensors_never_take_the_kernel() -> None:
    weight, scale, _ = fp8_weight(32, 64)
    never = functools.partial(pytest.fail, "not measured")
    assert fp8_gemv.choose(torch.randn(17, 64), weight, scale, never) is None  # INTERPRETED_ON_CPU or not
    assert fp8_gemv.choose(torch.randn(1, 64), weight, scale, never) is None  # a CPU tensor, not interpreted
    assert fp8_gemv.chosen() == {}


def test_a_kernel_that_computes_wrong_is_refused_and_scaled_mm_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The self-check: however fast, a tile whose product is off (a GPU or Triton miscompiling it) is never
    chosen, and the refusal is logged. Here every tile disagrees with the check's de-quantized product by 2x
    (as a kernel that lost a scale would)."""
    reference = fp8_gemv._reference
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_reference", lambda *args: 2 * reference(*args))
    weight, scale, _ = fp8_weight(32, 64, seed=4)
    x = torch.randn(1, 64)
    assert fp8_gemv.choose(x, weight, scale, lambda x: scaled_product(x, weight, scale)) is None
    assert "fp8 Triton tiles refused for [32 x 64] at 1 rows" in caplog.text and "off by" in caplog.text


def test_a_measurement_that_fails_leaves_scaled_mm_serving_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Measuring needs memory for its probe and reference: a failure there (a full GPU) never fails the step."""

    def out_of_memory(*_: object) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "_reference", out_of_memory)
    weight, scale, _ = fp8_weight(32, 64, seed=5)
    x = torch.randn(1, 64)
    torch.testing.assert_close(fp8_linear(x, weight, scale), scaled_product(x, weight, scale))
    assert "measuring the fp8 Triton kernel for [32 x 64] failed (CUDA out of memory)" in caplog.text
    assert list(fp8_gemv.chosen().values()) == [None]  # not measured again at every product
