"""Block-wise fp8 weights on `fp8_gemv`'s kernel (issue #39: Qwen3's and DeepSeek's FP8 releases, scales by blocks
of 128 x 128, ``weight_scale_inv``): each output row's block scales (`fp8_gemv.block_scales`), the kernel under
Triton's interpreter on CPU tensors (tiles whose inputs lie in one block scale their sums, wider tiles scale each
weight), the choice between its tiles and the de-quantized product, and the loader keeping them where asked."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from helpers.fp8_weights import fresh_choices  # noqa: F401 - an autouse fixture
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fp8_ops import dequantize_fp8, fp8_linear
from lmiserve.engine.model.quant_formats import Fp8Linear, fp8_module
from lmiserve.engine.model.quantize import Q8Linear

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))  # (the GPU check runs this file on CUDA)
# bf16 activations on a GPU (the kernel's tensor-core tiles round fp32 to tf32 there); fp32 under the interpreter
DTYPE, CLOSE = (torch.bfloat16, 2e-2) if DEVICE.type == "cuda" else (torch.float32, 1e-5)
pytestmark = pytest.mark.skipif(
    not fp8_gemv.available() or (DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs a CUDA GPU, or triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within `CLOSE` of `want`'s largest magnitude (bf16's rounding of the rows and the output, on a GPU)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=0.0, atol=CLOSE * want.abs().max().item())


def block_weight(out: int, inputs: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[out, inputs]`` fp8 weight and its ``weight_scale_inv`` by blocks (partial blocks at the ends), as
    the releases store them: each block's ``max|w| / 448``, the scales far apart between blocks."""
    torch.manual_seed(seed)
    rows, width = block
    grid = (-(-out // rows), -(-inputs // width))
    scale = torch.rand(grid) * 0.01 + 1e-4
    q = (torch.randn(out, inputs) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The published de-quantization (transformers' FineGrainedFP8): each weight times its block's scale."""
    rows, width = block
    full = scale.repeat_interleave(rows, dim=0)[: q.shape[0]].repeat_interleave(width, dim=1)[:, : q.shape[1]]
    return q.float() * full


SHAPES = [(96, 256, (32, 64)), (80, 200, (32, 64)), (64, 384, (128, 128)), (48, 96, (16, 16))]
TILES = [
    fp8_gemv.Config(False, 1, 16, 64),  # a tile's inputs in one block: the sums scaled
    fp8_gemv.Config(False, 1, 16, 128),  # wider than a block of 64 or 16: each weight scaled
    fp8_gemv.Config(False, 4, 16, 32, split_k=2),
    fp8_gemv.Config(True, 16, 32, 64),
    fp8_gemv.Config(True, 16, 32, 128, split_k=2),
    fp8_gemv.Config(False, 1, 16, 64, split_k=2, adds_in_kernel=True, late_sum=True),  # weights scaled, kept
    fp8_gemv.Config(False, 1, 16, 128, late_sum=True),
    fp8_gemv.Config(False, 4, 16, 32, split_k=2, adds_in_kernel=True, prefetch=True),
]


@pytest.mark.parametrize("widen", [False, True], ids=["fp8-gpu", "no-fp8-gpu"])
@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize(("out", "inputs", "block"), SHAPES, ids=str)
def test_the_kernel_computes_the_block_wise_dequantized_product(
    out: int, inputs: int, block: tuple[int, int], tile: fp8_gemv.Config, widen: bool
) -> None:
    q, scale = block_weight(out, inputs, block)
    rows = fp8_gemv.block_scales(scale, out, inputs, block)
    assert rows is not None and rows.shape == (out, -(-inputs // block[1]))
    assert fp8_gemv.input_block(inputs, rows) == block[1]
    want_weight = reference(q, scale, block)
    assert torch.equal(dequantize_fp8(q, rows), want_weight)
    x = torch.randn(tile.block_m + 1, inputs).to(DTYPE)  # (a partial row tile too)
    got = fp8_gemv.fp8_gemv(x.to(DEVICE), q.to(DEVICE), rows.to(DEVICE), tile, widen=widen)
    assert got.dtype == DTYPE
    close(got.cpu(), x.float() @ want_weight.t())


def test_block_scales_rows_and_what_stays_de_quantized() -> None:
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rows = fp8_gemv.block_scales(scale, 3, 100, (2, 64))
    assert rows is not None and rows.tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]
    one = fp8_gemv.block_scales(torch.tensor([[5.0], [6.0]]), 3, 64, (2, 64))  # one block spans the inputs
    assert one is not None and one.dim() == 1 and one.tolist() == [5.0, 5.0, 6.0]
    assert fp8_gemv.block_scales(scale, 3, 100, (2, 48)) is None  # 48 inputs a block: not told by the shape
    assert fp8_gemv.block_scales(scale, 3, 300, (2, 64)) is None  # (blocks that do not cover the inputs)
    assert fp8_gemv.input_block(100, torch.ones(3)) == 0  # per channel


@pytest.mark.parametrize("native", [True, False], ids=["fp8-gpu", "no-fp8-gpu"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fp8_linear_chooses_a_tile_against_the_de_quantized_product_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, native: bool, rows: int
) -> None:
    """Block-wise scales never go to ``torch._scaled_mm`` (its row-wise product has one scale a channel): on a GPU
    with fp8 products too, every row count is this kernel's or the de-quantized product's."""
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_devices, "native", lambda device: native)
    small = {b: tuple(c for c in cs if c.split_k == 1)[:1] for b, cs in fp8_gemv.CANDIDATES.items()}
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", small)  # (few tiles: the interpreter)
    q, scale = block_weight(64, 256, (32, 128))
    scales = fp8_gemv.block_scales(scale, 64, 256, (32, 128))
    assert scales is not None
    q, scales = q.to(DEVICE), scales.to(DEVICE)
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    x = torch.randn(rows, 256).to(DEVICE, DTYPE)
    want = x.float() @ reference(q.cpu(), scale, (32, 128)).t().to(DEVICE)
    close(fp8_linear(x, q, scales), want)
    ((key, _),) = fp8_gemv.chosen().items()  # measured once (on a CPU the de-quantized product wins)
    assert key == (x.device, 64, 256, fp8_gemv.bucket(rows), DTYPE, 2, False, torch.float8_e4m3fn, False)  # (2 blocks)
    assert f"fp8 products [64 x 256] at {fp8_gemv.bucket(rows)} row(s)" in caplog.text
    assert "the de-quantized product" in caplog.text and "_scaled_mm" not in caplog.text
    fp8_gemv._chosen[key] = small[fp8_gemv.bucket(rows)][0]  # as where a tile measures faster
    ran = []
    kernel = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda *args: ran.append(args[3]) or kernel(*args))
    close(fp8_linear(x, q, scales), want)
    assert ran == [small[fp8_gemv.bucket(rows)][0]]


def test_fp8_module_keeps_block_wise_weights_only_where_asked() -> None:
    q, scale = block_weight(64, 256, (32, 128))
    kept = fp8_module(q, scale, None, torch.float32, torch.device("cpu"), keep_fp8=True, block=(32, 128))
    assert isinstance(kept, Fp8Linear) and kept.scales.shape == (64, 2)
    assert torch.equal(kept.dequantized(), reference(q, scale, (32, 128)))
    assert "blocks of 128 inputs" in kept.extra_repr()
    on_cpu = fp8_module(q, scale, None, torch.float32, torch.device("cpu"), block=(32, 128))  # (cpu_codes.fp8_layer)
    assert isinstance(on_cpu, Q8Linear) and on_cpu.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(on_cpu.dequantized(), reference(q, scale, (32, 128)))
    in_bf16 = fp8_module(q, scale, None, torch.bfloat16, torch.device("cpu"), block=(32, 128))  # (kept too)
    assert isinstance(in_bf16, Q8Linear) and torch.equal(in_bf16.dequantized(), reference(q, scale, (32, 128)))
    x = torch.randn(3, 256).bfloat16()  # (the product in fp32, rounded to the rows' bf16 once)
    want = (x.float() @ reference(q, scale, (32, 128)).t()).bfloat16()
    torch.testing.assert_close(in_bf16(x), want, rtol=2**-7, atol=1e-6 * want.abs().max().item())
    odd = fp8_module(q, scale[:, :1], None, torch.float32, torch.device("cpu"), keep_fp8=True, block=(32, 256))
    assert isinstance(odd, Fp8Linear) and odd.scales.dim() == 1  # one block spans the inputs: per channel
    unkept = fp8_module(q, torch.ones(2, 6), None, torch.float32, torch.device("cpu"), keep_fp8=True, block=(32, 48))
    assert type(unkept) is torch.nn.Linear  # 48 inputs a block: de-quantized at load
