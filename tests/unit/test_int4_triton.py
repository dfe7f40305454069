"""`int4_triton` (issue #39): the AWQ/GPTQ 4-bit Triton kernel, its tiles' choice by measurement, and its
weights fused by the fast path, run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET on a CPU). The engine on these weights: test_quantized_checkpoints.py. On a GPU the GPU check
runs those engine tests and times the kernel (benchmarks/quantized_kernels.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lmiserve.engine.model import int4_triton
from lmiserve.engine.model.cpu_gemm import CpuGemm
from lmiserve.engine.model.int4_triton import Config, Int4Scales, Int4TritonLinear
from lmiserve.engine.model.llama_layout import _fuse_runs
from lmiserve.engine.model.quant_formats import Int4Parts
from lmiserve.models.quant_pack import rtn_int4

pytestmark = pytest.mark.skipif(
    not int4_triton.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4_triton, "_chosen", {})


def int4_layer(
    out: int, inputs: int, group: int, act_order: bool, seed: int = 0, bias: bool = False, order_seed: int = 0
) -> tuple[Int4TritonLinear, torch.Tensor]:
    """A 4-bit linear of random weights (RTN, `quant_pack`'s) and its de-quantized fp32 weight ``[out, in]``,
    computed from the codes by `Int4Parts.dequantize` (the loaders' reference), not by the kernel's module;
    `order_seed` draws act-order's order of the inputs."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inputs, generator=generator)
    g_idx = torch.arange(inputs) // group
    if act_order:  # GPTQ's desc_act: the inputs' groups in another order
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(order_seed))]
    codes, scale, zero = rtn_int4(weight, g_idx, inputs // group)
    dense = Int4Parts(codes.to(torch.uint8), scale.float(), zero, g_idx).dequantize()
    b = torch.randn(out, generator=generator) if bias else None
    layer = Int4TritonLinear.from_parts(codes, scale.float(), zero, g_idx, b, torch.float32, torch.device("cpu"))
    return layer, dense


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [1, 3, 16, 21])
def test_every_candidate_tile_computes_the_dequantized_product(rows: int, group: int, act_order: bool) -> None:
    """Each tile its row bucket measures (per-row sums, tensor-core tiles; `block_k` fitted to the groups),
    40 outputs (not a multiple of any tile), groups of one tile or several tiles, in order or act-order:
    fp32 activations give fp32's product of the de-quantized weight."""
    layer, dense = int4_layer(40, 256, group, act_order)
    assert (layer.scales.group, layer.scales.order is not None) == (group, act_order)
    x = torch.randn(rows, 256)
    want = x @ dense.t()
    tiles = {c.fitted(group) for c in int4_triton.CANDIDATES[int4_triton.bucket(rows)]}
    assert all(group % tile.block_k == 0 for tile in tiles)
    for tile in tiles:
        got = int4_triton.int4_gemm(x, layer.weight, layer.scales, tile)
        assert got.dtype == torch.float32 and got.shape == (rows, 40)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=str(tile))
    torch.testing.assert_close(
        int4_triton.dequantized_product(x, layer.weight, layer.scales), want, rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_come_back_in_their_dtype_within_its_rounding(dtype: torch.dtype) -> None:
    """A bf16 or fp16 model's rows on the per-row tiles; the tensor-core tile in fp16 (the interpreter's dot
    has no bf16: `choose`'s check against the de-quantized product is what catches such a kernel)."""
    layer, dense = int4_layer(48, 128, 64, act_order=True, seed=1, bias=True)
    x = torch.randn(2, 128).to(dtype)
    tiles = [Config(False, 4, 16, 64)] + ([Config(True, 16, 16, 32)] if dtype == torch.float16 else [])
    want = x.float() @ dense.t()
    for tile in tiles:
        got = int4_triton.int4_gemm(x, layer.weight, layer.scales, tile)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    got = layer(x.float()[None])  # the module: its bias, the leading dimensions kept
    assert got.shape == (1, 2, 48)
    torch.testing.assert_close(got[0], x.float() @ dense.t() + layer.bias, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("group_of", "servable"),
    [
        (lambda i: i // 64, True),  # AWQ's, GPTQ's: runs of 64
        (lambda i: (i * 7 % 256) // 64, True),  # act-order: runs once sorted
        (lambda i: i // 16, True),  # runs of 16, each padded to 32 (twice the inputs: the most padded)
        (lambda i: torch.clamp(i // 48, max=3), True),  # runs of unequal sizes (48 x 3, 112), padded to 128
        (lambda i: torch.where(i < 200, 0, i - 199), False),  # one of 200, 56 of one: padded, 50x the inputs
    ],
    ids=["runs-of-64", "act-order", "runs-of-16", "unequal-runs", "padded-too-wide"],
)
def test_only_groups_of_a_multiple_of_the_tile_are_served(group_of: object, servable: bool) -> None:
    """Runs of a multiple of the tile, or groups padded to one such size within twice the inputs; other layouts stay
    de-quantized to bf16 (`quant_formats.int4_module` asks for the `layout` first)."""
    g_idx = group_of(torch.arange(256))  # type: ignore[operator]
    groups = int(g_idx.max()) + 1
    assert (Int4TritonLinear.layout(g_idx, groups) is not None) is servable
    codes = torch.randint(0, 16, (32, 256), dtype=torch.uint8)
    scale, zero = torch.rand(32, groups), torch.randint(0, 16, (32, groups))
    if servable:
        Int4TritonLinear.from_parts(codes, scale, zero, g_idx, None, torch.float32, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="multiple of 32 consecutive inputs, or groups padded"):
            Int4TritonLinear.from_parts(codes, scale, zero, g_idx, None, torch.float32, torch.device("cpu"))


def test_choose_measures_once_per_shape_and_bucket_and_the_linear_runs_its_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Measured where the GPU would be (CPU tensors here): every candidate checked, then timed; the choice kept
    per shape, groups and row bucket, logged once, and run by `int4_linear`."""
    monkeypatch.setattr(int4_triton, "MEASURED_ON_CPU", True)
    layer, dense = int4_layer(48, 128, 64, act_order=False)
    caplog.set_level(logging.INFO, logger=int4_triton.__name__)
    ran: list[Config] = []
    kernel = int4_triton.int4_gemm
    monkeypatch.setattr(int4_triton, "int4_gemm", lambda x, w, p, c: ran.append(c) or kernel(x, w, p, c))
    x = torch.randn(3, 128)
    torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-4)
    key = (torch.device("cpu"), 48, 128, 64, False, 4, torch.float32)
    choice = int4_triton.chosen()[key]
    candidates = {c.fitted(64) for c in int4_triton.CANDIDATES[4]}
    assert choice in candidates and set(ran[:-1]) == candidates and ran[-1] == choice
    assert "int4 products [48 x 128] at 4 row(s) run on the Triton kernel" in caplog.text
    ran.clear()
    layer(torch.randn(2, 128))  # the same bucket: no measurement
    assert ran == [choice]
    layer(torch.randn(1, 128))  # another bucket: measured
    assert len(int4_triton.chosen()) == 2


def test_tiles_that_are_off_are_refused_and_the_dequantized_product_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel this GPU or Triton gets wrong (here: every tile 2x off the check's reference) never serves."""
    monkeypatch.setattr(int4_triton, "MEASURED_ON_CPU", True)
    layer, dense = int4_layer(32, 64, 32, act_order=False, seed=2)
    reference = int4_triton.dequantized_product
    monkeypatch.setattr(int4_triton, "dequantized_product", lambda *args: 2 * reference(*args))
    x = torch.randn(1, 64)
    assert int4_triton.choose(x, layer.weight, layer.scales) is None
    assert "int4 candidates refused for [32 x 64] at 1 rows" in caplog.text and "off by" in caplog.text
    monkeypatch.setattr(int4_triton, "dequantized_product", reference)
    torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-4)  # de-quantized a slice at a time


def test_a_measurement_that_fails_leaves_the_first_tile_serving_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(int4_triton, "MEASURED_ON_CPU", True)
    layer, dense = int4_layer(32, 64, 32, act_order=False, seed=3)

    def out_of_memory(*args: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(int4_triton, "dequantized_product", out_of_memory)
    x = torch.randn(1, 64)
    torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-4)
    assert int4_triton.chosen()[(torch.device("cpu"), 32, 64, 32, False, 1, torch.float32)] == (
        int4_triton.CANDIDATES[1][0].fitted(32)
    )
    assert "measuring the int4 Triton kernel for [32 x 64] failed (CUDA out of memory)" in caplog.text


def test_the_fast_path_fuses_linears_of_one_input_order_and_keeps_the_others_apart() -> None:
    """q/k/v (or gate/up) of the same groups and act-order fuse into one product of concatenated codes, scales
    and zeros; each module then reads its rows and columns of the fused tensors (no copy left behind) and
    computes what it computed before. A linear of another input order is a part of its own."""
    q, q_dense = int4_layer(64, 128, 64, act_order=True, seed=4, bias=True)
    k, k_dense = int4_layer(32, 128, 64, act_order=True, seed=5, bias=True)  # the same input order as q's
    v, _ = int4_layer(32, 128, 64, act_order=True, seed=6, bias=True, order_seed=1)  # another order
    x = torch.randn(5, 128)
    before = [m(x) for m in (q, k, v)]
    parts = _fuse_runs([q, k, v])  # type: ignore[list-item]
    assert [p.outputs for p in parts] == [96, 32]
    fused = parts[0]
    assert isinstance(fused.scales, Int4Scales) and fused.weight.shape == (96, 16)
    assert q.weight.data_ptr() == fused.weight.data_ptr() and k.scales.scales.stride(0) == 96
    for module, want in zip((q, k, v), before, strict=True):
        torch.testing.assert_close(module(x), want)
    got = CpuGemm().linear(x, fused.weight, fused.bias, fused.scales)
    want = torch.cat([x @ q_dense.t() + q.bias, x @ k_dense.t() + k.bias], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def rank_parts(parts: Int4Parts, world: int, rank: int) -> Int4Parts:
    """Rank `rank`'s part of a row-parallel linear's inputs, cut as the tensor-parallel loader cuts it."""
    from lmiserve.engine.model.shard_quantized import cut_codes

    share = parts.codes.shape[1] // world
    return cut_codes(parts, None, slice(rank * share, (rank + 1) * share))


@pytest.mark.parametrize(
    ("act_order", "inputs", "world"),
    [(True, 512, 2), (True, 512, 4), (False, 896, 8)],
    ids=["act-order-2-ranks", "act-order-4-ranks", "inside-groups-8-ranks"],
)
@pytest.mark.parametrize("rows", [1, 16])
def test_a_ranks_part_of_uneven_groups_is_served_padded(rows: int, act_order: bool, inputs: int, world: int) -> None:
    """A tensor-parallel rank's part of a row-parallel linear's inputs in groups of 128: of GPTQ's act-order inputs
    (each group's inputs spread over the ranks: a rank's part of each uneven), or in order over 8 ranks (896
    inputs: 112 a rank, starting and ending inside groups, whole finer groups only of 16, under the kernel's 32).
    Each group of the part is padded to one size, its pads reading code 0 from a zero column: every tile computes
    the part's de-quantized product, and the stored inputs are at most twice the part's."""
    generator = torch.Generator().manual_seed(7)
    g_idx = torch.arange(inputs) // 128
    if act_order:
        g_idx = g_idx[torch.randperm(inputs, generator=generator)]
    codes, scale, zero = rtn_int4(torch.randn(40, inputs, generator=generator), g_idx, inputs // 128)
    whole = Int4Parts(codes.to(torch.uint8), scale.float(), zero, g_idx)
    x = torch.randn(rows, inputs, generator=generator)
    share = inputs // world
    for rank in range(world):
        part = rank_parts(whole, world, rank)
        size = part.group_size()
        assert size is None or size % 32  # (uneven groups, or one of 112: no layout but the padded one)
        layer = Int4TritonLinear.from_parts(
            part.codes, part.scale, part.zero, part.g_idx, None, torch.float32, torch.device("cpu")
        )
        stored = layer.weight.shape[1] * 8
        assert layer.in_features == share < stored <= 2 * share and layer.scales.order is not None
        assert stored == part.scale.shape[1] * layer.scales.group and layer.scales.group % 32 == 0
        own = x[:, rank * share : (rank + 1) * share]
        want = own @ part.dequantize().t()
        torch.testing.assert_close(part.dequantize(), whole.dequantize()[:, rank * share : (rank + 1) * share])
        for tile in {c.fitted(layer.scales.group) for c in int4_triton.CANDIDATES[int4_triton.bucket(rows)]}:
            got = int4_triton.int4_gemm(own, layer.weight, layer.scales, tile)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"rank {rank} {tile}")
        torch.testing.assert_close(layer(own), want, rtol=1e-5, atol=1e-4)  # (the module: its chosen tile)
        torch.testing.assert_close(
            int4_triton.dequantized_product(own, layer.weight, layer.scales), want, rtol=1e-5, atol=1e-4
        )


def test_padded_layout_orders_each_groups_inputs_then_its_pads() -> None:
    g_idx = (torch.arange(40) % 8 >= 5).long()  # group 0: the 25 inputs i % 8 < 5; group 1: the 15 others
    layout = int4_triton.padded_layout(g_idx, 2)
    assert layout is not None
    order, size = layout
    assert size == 32 and order.shape == (64,)
    assert order[:25].tolist() == [i for i in range(40) if i % 8 < 5] and order[25:32].tolist() == [40] * 7
    assert order[32:47].tolist() == [i for i in range(40) if i % 8 >= 5] and order[47:].tolist() == [40] * 17
    assert int4_triton.padded_layout(g_idx[:30], 2) is None  # 64 stored for 30: more than twice
