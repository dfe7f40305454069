"""`fp8_w8a8` (issue #39): a few rows quantized to fp8 by one Triton kernel, cuBLAS's tensor-wise fp8 product,
the scales applied by one more kernel; one of the products `fp8_gemv.choose` measures. Run on CPU tensors under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET on a CPU) with torch's CPU ``_scaled_mm``; the GPU
check's `quantized` step times it on a GPU (benchmarks/quantized_kernels.py, `fp8_w8a8`)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from helpers.fp8_weights import fp8_weight, fresh_choices  # noqa: F401 - an autouse fixture
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv, fp8_w8a8, kernel_choice
from lmiserve.engine.model.fp8_ops import fp8_linear, quantize_fp8, scaled_product

pytestmark = pytest.mark.skipif(
    not fp8_w8a8.applies(torch.empty(16, 16, dtype=torch.float8_e4m3fn), torch.device("cpu"))
    or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


def quantized(x: torch.Tensor, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizing kernel's padded bytes and row scales for `x`."""
    quantize, _ = fp8_w8a8._kernels()
    padded = -(-x.shape[0] // fp8_w8a8.PAD) * fp8_w8a8.PAD
    q = torch.full((padded, inputs), 0xFF, dtype=torch.uint8)  # NaN bytes: every one must be written
    scales = torch.full((padded,), -1.0)
    block = 1 << (inputs - 1).bit_length()
    quantize[(padded,)](x, q, scales, x.shape[0], inputs, x.stride(0), BLOCK_K=block)
    return q, scales


def timed_choices(monkeypatch: pytest.MonkeyPatch, seconds: dict[fp8_w8a8.RowsInFp8, float]) -> list[str]:
    """`fp8_gemv.choose` on CPU tensors with one tile a bucket, each candidate timed as `seconds` says (the others,
    the baseline too, 1 ms); the names of what it timed, in order."""
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:1] for b, configs in fp8_gemv.CANDIDATES.items()})
    timed: list[str] = []
    by_name = {str(choice): time for choice, time in seconds.items()}

    def timer(call: object, device: torch.device) -> float:
        name = str(getattr(call, "args", ("baseline",))[0])
        timed.append(name)
        return by_name.get(name, 1e-3)

    monkeypatch.setattr(kernel_choice, "time_gpu", timer)
    return timed


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("inputs", [96, 100], ids=["k-pow2-padded", "k-ragged"])
def test_the_quantizer_writes_torchs_fp8_bytes_and_scales_and_zero_padding_rows(rows: int, inputs: int) -> None:
    """Each row's bytes are those of `rows_to_fp8` (torch's own conversion: to nearest, ties to even) bit for bit,
    through the values where rounding carries into the exponent (7.94 -> 8), e4m3's subnormals, a row of zeros,
    +-448 and beyond; the padding rows up to the next 16 are zeros."""
    torch.manual_seed(rows)
    x = torch.randn(rows, inputs) * torch.logspace(-4, 3, rows)[:, None]
    # row 0 up to 448 (scale 1: its values exact): carries into the exponent, ties to even (1.0625 -> 1,
    # -1.1875 -> -1.25, 5.5 and 6.5 x 2**-9 -> 6 x 2**-9), subnormals, 448
    special = [7.9377, -31.2820, 127.7869, 1.9449, 1.0625, -1.1875, 5.5 / 512, 6.5 / 512, 1e-3, -448.0]
    x[0] = (torch.randn(inputs) * 100).clamp(-447, 447)
    x[0, : len(special)] = torch.tensor(special)
    if rows > 1:
        x[1] = 0.0
    q, scales = quantized(x, inputs)
    want_q, want_scales = fp8_w8a8.rows_to_fp8(x)
    assert torch.equal(q[:rows], want_q.view(torch.uint8))
    assert torch.equal(scales[:rows], want_scales[:, 0])
    assert not q[rows:].any()  # +0.0 bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
def test_the_product_is_the_rowwise_products_arithmetic(rows: int, dtype: torch.dtype) -> None:
    """cuBLAS's unscaled sums times each row's and channel's scale: fp32's product of the fp8 rows and the
    de-quantized weight (what the row-wise ``_scaled_mm`` computes), in the rows' dtype; outputs past one
    program of the scaling kernel (BLOCK_N) and rows past one padded block of 16."""
    weight, scale, dense = fp8_weight(fp8_w8a8.BLOCK_N + 32, 64, seed=rows)
    x = (torch.randn(rows, 64) * 3).to(dtype)
    got = fp8_w8a8.product(x, weight, scale)
    q, row_scales = fp8_w8a8.rows_to_fp8(x.float())
    want = (q.float() * row_scales) @ dense.t()
    assert got.dtype == dtype and got.shape == (rows, fp8_w8a8.BLOCK_N + 32)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    rowwise = scaled_product(x, weight, scale)  # (bf16 sums: Hopper's row-wise product writes only those)
    torch.testing.assert_close(got.float(), rowwise.float(), rtol=8e-3, atol=8e-3 * want.abs().max().item())


def test_it_competes_for_decode_rows_and_serves_when_chosen(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`fp8_gemv.choose` measures it beside the tiles for decode rows (checked against its own arithmetic: its
    fp8 activations are not the tiles' fp32 product, yet within the tolerance of the right one) and keeps it
    where it is the fastest; `fp8_linear` then runs it."""
    timed = timed_choices(monkeypatch, {fp8_w8a8.W8A8: 1e-6})
    weight, scale, _ = fp8_weight(48, 64, seed=7)
    x = torch.randn(2, 64) * 4
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    assert fp8_gemv.choose(x, weight, scale, lambda x: scaled_product(x, weight, scale)) is fp8_w8a8.W8A8
    assert str(fp8_w8a8.W8A8) in timed and str(fp8_gemv.CANDIDATES[4][0]) in timed and "baseline" in timed
    chosen = "fp8 products [48 x 64] at 4 row(s) run on cuBLAS fp8 x fp8, activations per row (the fastest candidate"
    assert chosen in caplog.text
    torch.testing.assert_close(fp8_linear(x, weight, scale), fp8_w8a8.product(x, weight, scale), rtol=0, atol=0)


def test_a_wrong_product_is_refused_and_it_never_competes_where_it_cannot_serve(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its self-check: a product off by a scale is refused (logged). Not a candidate for outputs or inputs not a
    multiple of 16 (cuBLAS's fp8 product refuses them), for 8-bit integer codes, on a GPU without fp8 products
    (an A100: no ``_scaled_mm``), or for a prompt's rows."""
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: () for b in fp8_gemv.CANDIDATES})
    weight, scale, _ = fp8_weight(48, 64, seed=8)
    right = fp8_w8a8.product
    monkeypatch.setattr(fp8_w8a8, "product", lambda *args: 2 * right(*args))
    assert fp8_gemv.choose(torch.randn(1, 64), weight, scale, lambda x: scaled_product(x, weight, scale)) is None
    assert "fp8 candidates refused for [48 x 64] at 1 rows: cuBLAS fp8 x fp8, activations per row: off by" in (
        caplog.text
    )
    assert not fp8_w8a8.applies(torch.empty(40, 64, dtype=torch.float8_e4m3fn), torch.device("cpu"))
    assert not fp8_w8a8.applies(torch.empty(48, 72, dtype=torch.float8_e4m3fn), torch.device("cpu"))
    assert fp8_w8a8.applies(weight, torch.device("cpu"))
    assert not fp8_w8a8.applies(torch.empty(48, 64, dtype=torch.int8), torch.device("cpu"))  # int8 codes
    monkeypatch.setattr(fp8_devices, "native", lambda device: False)
    assert not fp8_w8a8.applies(weight, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_of_a_one_scale_weight_takes_cublas_scales_in_two_kernels(dtype: torch.dtype) -> None:
    """`product_one_scale`: the row in fp8 over its range and one ``_scaled_mm`` whose scales are the row's and the
    weight's: the same arithmetic as `product`'s three kernels, written in the row's dtype by cuBLAS."""
    torch.manual_seed(3)
    weight, scale = quantize_fp8(torch.randn(fp8_w8a8.BLOCK_N + 32, 64) * 0.05, per_tensor=True)
    scales = scale.expand(weight.shape[0]).contiguous()
    x = (torch.randn(1, 64) * 3).to(dtype)
    got = fp8_w8a8.product_one_scale(x, weight, scales)
    q, row_scales = fp8_w8a8.rows_to_fp8(x.float())
    want = (q.float() * row_scales) @ (weight.float() * scale).t()
    assert got.dtype == dtype and got.shape == (1, weight.shape[0])
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    torch.testing.assert_close(got, fp8_w8a8.product(x, weight, scales), rtol=tolerance, atol=tolerance * 8)
    with pytest.raises(ValueError, match="takes one row, not 2"):
        fp8_w8a8.product_one_scale(x.expand(2, -1), weight, scales)


def test_whether_scales_are_one_value_is_read_once_a_tensor() -> None:
    """`one_scale`: a per-tensor weight's scales (one value, expanded) are, a per-channel weight's are not, block
    scales never; read once a tensor (a host sync) and remembered while it lives."""
    _, channel, _ = fp8_weight(48, 64, seed=9)
    _, tensor = quantize_fp8(torch.randn(48, 64), per_tensor=True)
    one = tensor.expand(48).contiguous()
    assert fp8_w8a8.one_scale(one) and not fp8_w8a8.one_scale(channel)
    assert not fp8_w8a8.one_scale(one.expand(2, 48))
    one[0] = 2.0  # (scales never change in place: remembered, not read again)
    assert fp8_w8a8.one_scale(one)
    assert not fp8_w8a8.one_scale(one.clone())  # another tensor: read


def test_it_competes_only_for_one_row_of_a_weight_with_one_scale(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`fp8_gemv.choose` times `ONE_SCALE` beside `W8A8` and the tiles for one row of a weight whose scales are one
    value, keeps it where fastest, and `fp8_linear` then runs it; never for 2 rows or per-channel scales (where its
    scale would be wrong). Off by a scale it is refused by the self-check."""
    timed = timed_choices(monkeypatch, {fp8_w8a8.ONE_SCALE: 1e-7, fp8_w8a8.W8A8: 1e-6})
    weight, scale = quantize_fp8(torch.randn(48, 64) * 0.05, per_tensor=True)
    scales = scale.expand(48).contiguous()
    x = torch.randn(1, 64) * 4
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    assert fp8_gemv.choose(x, weight, scales, lambda x: scaled_product(x, weight, scales)) is fp8_w8a8.ONE_SCALE
    assert {str(fp8_w8a8.ONE_SCALE), str(fp8_w8a8.W8A8), "baseline"} <= set(timed)
    assert "fp8 products [48 x 64] at 1 row(s) run on cuBLAS fp8 x fp8, one scale a tensor" in caplog.text
    torch.testing.assert_close(fp8_linear(x, weight, scales), fp8_w8a8.product_one_scale(x, weight, scales))
    timed.clear()
    assert fp8_gemv.choose(x.expand(2, -1), weight, scales, lambda x: x) is fp8_w8a8.W8A8
    _, channel, _ = fp8_weight(48, 64, seed=10)
    assert fp8_gemv.choose(x, weight, channel, lambda x: scaled_product(x, weight, channel)) is fp8_w8a8.W8A8
    assert str(fp8_w8a8.ONE_SCALE) not in timed
    monkeypatch.setattr(fp8_gemv, "_chosen", {})
    right = fp8_w8a8.product_one_scale
    monkeypatch.setattr(fp8_w8a8, "product_one_scale", lambda *args: 1.05 * right(*args))
    assert fp8_gemv.choose(x, weight, scales, lambda x: scaled_product(x, weight, scales)) is fp8_w8a8.W8A8
    assert "cuBLAS fp8 x fp8, one scale a tensor: off by" in caplog.text
