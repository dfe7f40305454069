"""8-bit integer codes kept on a GPU (issue #39, `int8_weights`): compressed-tensors' W8A8 and W8A16 checkpoints keep
their int8 codes on `fp8_gemv`'s weight-only kernel where de-quantized to bf16 they would not fit (a 70B W8A8 model on
one 80 GB GPU), or where ``LMISERVE_USE_TRITON_INT8=1``. The kernel runs under Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET on a CPU); the loaders ask once per load and per rank, the answer given
here (a GPU's answer from its free memory and compute capability: test_weight_fit.py). The engine's tokens over such layers:
test_quantized_checkpoints.py; on a GPU the GPU check runs that file's `on the test device` cases with the codes kept."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from helpers.float_weights import weight_of
from helpers.fp8_weights import fresh_choices  # noqa: F401 - an autouse fixture
from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv, fp8_w8a8, int8_w8a8, int8_weights, kernel_choice
from lmiserve.engine.model.int8_weights import Int8Scales, Int8WeightLinear
from lmiserve.engine.model.quant_formats import Int4Parts, int8_module
from lmiserve.engine.model.quantize import Q8Linear, int4_available, quantized_linear
from lmiserve.engine.model.shard_checkpoint import load_shard_weights
from lmiserve.engine.model.sharding import shard_model
from lmiserve.models.load import load_model_shell
from lmiserve.models.quantized_load import checkpoint_quantization, load_quantized

interpreted = pytest.mark.skipif(
    not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)
CPU = torch.device("cpu")


def int8_parts(out: int, inputs: int, group: int, seed: int = 0, zero: int = 128) -> Int4Parts:
    """Random 8-bit codes ``[out, inputs]`` (stored as the signed code + 128, as `packed_codes` reads them) with a
    scale a group of `group` inputs (0: a channel) and the zero `zero` (128: symmetric)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out, inputs), generator=generator, dtype=torch.uint8)
    groups = 1 if group == 0 else -(-inputs // group)
    scale = torch.rand(out, groups, generator=generator) * 0.01 + 1e-3
    g_idx = torch.arange(inputs) // (inputs if group == 0 else group)
    return Int4Parts(codes, scale, torch.full((out, groups), zero, dtype=torch.int32), g_idx, bits=8)


@interpreted
@pytest.mark.parametrize(
    "config",
    [
        fp8_gemv.Config(False, 1, 16, 32),
        fp8_gemv.Config(False, 4, 16, 64, split_k=2, adds_in_kernel=True),
        fp8_gemv.Config(False, 1, 16, 32, late_sum=True, prefetch=True),
        fp8_gemv.Config(True, 16, 16, 32),
    ],
    ids=str,
)
@pytest.mark.parametrize("group", [0, 32, 16], ids=["channel", "g32", "g16"])
@pytest.mark.parametrize("native", [True, False], ids=["fp8-gpu", "no-fp8-gpu"])
def test_the_kernel_computes_the_codes_de_quantized_product(
    config: fp8_gemv.Config, group: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per channel, by groups of a tile (32) and by groups smaller than a tile's inputs (16: each code scaled before
    the product), ragged inputs (100, by channel): fp32 rows give fp32's product of the de-quantized codes, on a GPU with fp8
    conversions or without (the codes are never read as fp8 bytes)."""
    monkeypatch.setattr(fp8_devices, "native", lambda device: native)
    parts = int8_parts(40, 100 if group == 0 else 96, group)
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    assert isinstance(layer, Int8WeightLinear)
    x = torch.randn(5, parts.codes.shape[1])
    got = fp8_gemv.fp8_gemv(x, layer.weight, layer.scales.scales, config)
    torch.testing.assert_close(got, x @ parts.dequantize().t(), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("config", [fp8_gemv.Config(False, 1, 16, 64), fp8_gemv.Config(True, 16, 16, 64)], ids=str)
def test_every_code_comes_back_exactly(config: fp8_gemv.Config) -> None:
    """-128 to 127 in every row, in its own order: the rows of the identity read each column exactly, in fp32 and
    in bf16 activations (every code is a bf16)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.stack([torch.randperm(256, generator=generator) - 128 for _ in range(24)]).to(torch.int8)
    ones = torch.ones(24)
    for dtype in (torch.float32, torch.bfloat16):
        rows = 1 if not config.use_dot else 256
        for start in range(0, 256, rows):
            x = torch.eye(256, dtype=dtype)[start : start + rows]
            got = fp8_gemv.fp8_gemv(
                x if dtype == torch.float32 or not config.use_dot else x.half(), weight, ones, config
            )
            assert torch.equal(got.float(), weight.float()[:, start : start + rows].t()), (dtype, start)


@interpreted
def test_choose_measures_every_row_count_against_the_de_quantized_product_never_scaled_mm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU with fp8 products too, int8 codes are measured at every bucket (no ``_scaled_mm``, no fp8 rows),
    against the weight de-quantized a slice at a time, each choice kept apart from an fp8 weight's of one shape; the
    layer's product and the fast path's (`quantized_linear`, by the scales' type) are the de-quantized product's."""
    monkeypatch.setattr(fp8_devices, "native", lambda device: True)
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:1] for b, configs in fp8_gemv.CANDIDATES.items()})
    scaled_mm: list[int] = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: scaled_mm.append(1))
    parts = int8_parts(40, 64, 32, seed=3)
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    dense = parts.dequantize()
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    for rows, size in ((1, 1), (3, 4), (17, 64), (65, 256), (257, 1024)):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(quantized_linear(x, layer.weight, layer.scales), x @ dense.t(), rtol=1e-5, atol=1e-5)
        assert (CPU, 40, 64, size, torch.float32, 2, False, torch.int8, False) in fp8_gemv.chosen()
        assert f"int8 products [40 x 64] at {size} row(s)" in caplog.text
    assert not scaled_mm and "torch._scaled_mm" not in caplog.text


@pytest.mark.parametrize(
    ("group", "zero", "act_order", "kept"),
    [
        (0, 128, False, True),  # W8A8: a scale a channel
        (32, 128, False, True),  # W8A16 by groups
        (32, 130, False, False),  # asymmetric codes: de-quantized
        (48, 128, False, False),  # groups of a size the kernel cannot read from the scales' shape
        (32, 128, True, True),  # act-ordered groups: stored in group order (input_order)
    ],
    ids=["channel", "g32", "asymmetric", "g48", "act-order"],
)
def test_the_codes_are_kept_where_the_kernel_serves_them(group: int, zero: int, act_order: bool, kept: bool) -> None:
    """Where the loader keeps them, symmetric codes by channel or by groups of a power of two run the kernel; the
    rest is de-quantized at load (the same weights, exactly); where it does not keep them, de-quantized on CUDA as
    before, and on a CPU in fp32 symmetric codes run the CPU's q8 kernel (`cpu_codes.q8_layer`), exactly too."""
    parts = int8_parts(32, 96, group, zero=zero)
    if act_order:
        parts.g_idx = parts.g_idx[torch.randperm(96, generator=torch.Generator().manual_seed(1))]
    bias = torch.randn(32)
    layer = int8_module(parts, bias, torch.float32, CPU, keep_codes=True)
    assert isinstance(layer, Int8WeightLinear) is kept
    assert torch.equal(weight_of(layer), parts.dequantize())
    assert torch.equal(layer.bias, bias)
    cpu = int8_module(parts, bias, torch.float32, CPU, keep_codes=False)
    assert type(cpu) is (Q8Linear if zero == 128 and int4_available() else torch.nn.Linear)
    assert torch.equal(weight_of(cpu), parts.dequantize()) and torch.equal(cpu.bias, bias)
    if kept:
        order = ", inputs in group order" if act_order else ""
        assert str(layer).endswith(
            "int8 codes (a scale a channel))" if group == 0 else f"groups of {group} inputs{order}))"
        )


@pytest.mark.parametrize(("fmt", "group"), [("w8a8", 0), ("w8a16", 32)])
@pytest.mark.parametrize("answer", [True, None], ids=["kept", "not-asked"])
def test_one_process_and_a_rank_ask_once_and_keep_the_codes_where_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, group: int, answer: bool | None
) -> None:
    """A W8A8 or W8A16 checkpoint in one process and a tensor-parallel rank's cut of it each ask once, of what they
    load; where the answer is to keep (a GPU where bf16 would not fit), every linear of the layers is an
    `Int8WeightLinear` whose weights are the de-quantized ones of the other answer, exactly."""
    folder = write_checkpoint(quantizable_llama(39), tmp_path / fmt, fmt, group)
    asked: list[str] = []

    def spy(model: torch.nn.Module, device: torch.device, name: str) -> bool | None:
        asked.append(name)
        return answer

    monkeypatch.setattr(int8_weights, "weights_kept_for", spy)
    spec = checkpoint_quantization(folder, None)
    assert spec is not None and spec.method == "int8"
    whole, _ = load_quantized(folder, spec, torch.float32, CPU)
    shell = load_model_shell(folder, dtype="fp32", device="cpu").model
    shard_model(shell, 1, 2, None)
    load_shard_weights(shell, folder, spec, CPU)
    assert asked == [fmt, "rank 1"]
    monkeypatch.setattr(int8_weights, "weights_kept_for", lambda *args: False)
    plain, _ = load_quantized(folder, spec, torch.float32, CPU)
    assert spec.int8_activations is (fmt == "w8a8")  # W8A8's int8 activations by token: its rows may go to int8
    for model in (whole, shell):
        layer = model.model.layers[0]
        for module in (layer.mlp.down_proj, layer.self_attn.q_proj):
            assert isinstance(module, Int8WeightLinear) is bool(answer)
            assert not answer or module.scales.int8_rows is (fmt == "w8a8")
    for name in ("mlp.down_proj", "self_attn.q_proj", "mlp.gate_proj"):
        got = whole.model.layers[1].get_submodule(name)
        want = weight_of(plain.model.layers[1].get_submodule(name))
        assert torch.equal(weight_of(got), want), name


def test_the_fast_path_reads_the_scales_type_not_the_codes_dtype() -> None:
    """CPU int8 rows (bf16 scales) and q8 blocks keep their kernels; `Int8Scales` go to the GPU kernel's product."""
    parts = int8_parts(16, 64, 32, seed=4)
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    assert isinstance(layer.scales, Int8Scales) and layer.weight.dtype == torch.int8
    x = torch.randn(2, 64)
    torch.testing.assert_close(quantized_linear(x, layer.weight, layer.scales), x @ parts.dequantize().t())


def test_codes_by_groups_skip_the_tiles_that_spill_there() -> None:
    """By groups, the tiles that load a step ahead and add their splits in the kernel are not tried (they spill
    registers on Hopper: test_kernels_compile_for_cuda.py); by channel, and fp8 weights by blocks, every tile is."""
    codes, fp8 = torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    by_groups, by_channel = torch.ones(8, 2), torch.ones(8)
    for bucket, tiles in fp8_gemv.CANDIDATES.items():
        tried = fp8_gemv.tiles_for(bucket, codes, by_groups)
        assert tried == tuple(t for t in tiles if not (t.prefetch and t.adds_in_kernel))
        assert fp8_gemv.tiles_for(bucket, codes, by_channel) == tiles == fp8_gemv.tiles_for(bucket, fp8, by_groups)
    assert len(fp8_gemv.tiles_for(1, codes, by_groups)) < len(fp8_gemv.CANDIDATES[1])


@interpreted
def test_the_rows_kernel_gives_rows_to_int8s_codes_and_scales_padded_with_zero_rows() -> None:
    """Each row over its own range (max |row| / 127), rounded to nearest with ties to even (2.5 -> 2, -3.5 -> -4,
    0.5 -> 0 where the scale is 1), clamped to +-127; an all-zero row gets fp32's smallest normal as its scale; the
    rows added for ``torch._int_mm`` (more than 16, a multiple of 8) are zeros."""
    ties = torch.tensor([[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -127.0, 126.5]])
    x = torch.cat([ties, torch.zeros(1, 8), torch.randn(3, 8) * 5])
    padded = int8_w8a8.padded_rows(x.shape[0])
    assert (padded, int8_w8a8.padded_rows(17), int8_w8a8.padded_rows(33)) == (24, 24, 40)
    q = torch.full((padded, 8), 99, dtype=torch.int8)
    scales = torch.empty(padded)
    fp8_w8a8.quantize_rows(x, q, scales, int8=True)
    want_q, want_scales = int8_w8a8.rows_to_int8(x)
    assert torch.equal(q[: x.shape[0]], want_q) and torch.equal(scales[: x.shape[0]], want_scales[:, 0])
    assert q[0].tolist() == [127, 2, -4, 0, 0, 2, -127, 126]
    assert scales[1].item() == torch.finfo(torch.float32).tiny
    assert not q[x.shape[0] :].any()


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_int8_rows_product_is_its_arithmetic_in_fp32(rows: int, dtype: torch.dtype) -> None:
    """Three kernels (rows to int8, ``torch._int_mm``'s exact int32 sums, each sum times its row's and channel's
    scale) give the product of the rows as quantized with the de-quantized weight: fp32 to its rounding, bf16 to
    its own; the output in the rows' dtype."""
    parts = int8_parts(48, 64, 0, seed=rows)
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    got = int8_w8a8.product(x, layer.weight, layer.scales.scales)
    want = int8_w8a8.INT8_ROWS.quantized(x.float()) @ parts.dequantize().t()
    assert got.dtype == dtype and got.shape == (rows, 48)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_the_int8_rows_serve_w8a8s_codes_by_channel_only() -> None:
    """Int8 codes a scale a channel, both dimensions multiples of 8; never fp8 weights, scales by groups, or
    dimensions the integer product refuses."""
    codes, channel, groups = torch.zeros(48, 64, dtype=torch.int8), torch.ones(48), torch.ones(48, 2)
    assert int8_w8a8.applies(codes, channel, CPU)
    assert not int8_w8a8.applies(codes, groups, CPU)
    assert not int8_w8a8.applies(codes.to(torch.float8_e4m3fn), channel, CPU)
    assert not int8_w8a8.applies(torch.zeros(48, 60, dtype=torch.int8), channel, CPU)
    assert not int8_w8a8.applies(torch.zeros(44, 64, dtype=torch.int8), torch.ones(44), CPU)


@interpreted
@pytest.mark.parametrize(("int8_rows", "group"), [(True, 0), (False, 0), (True, 32)], ids=["w8a8", "w8a16", "groups"])
def test_choose_offers_the_int8_rows_to_w8a8s_codes_and_serves_them_where_fastest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, int8_rows: bool, group: int
) -> None:
    """W8A8's codes (int8 activations) have the int8 rows among their candidates at every bucket, checked against
    the same arithmetic in fp32; where they time fastest, the layer's products and the fast path's run them (the
    choice kept apart from the weight-only one of the same shape); W8A16's codes and codes by groups never."""
    monkeypatch.setattr(fp8_gemv, "INTERPRETED_ON_CPU", True)
    monkeypatch.setattr(fp8_gemv, "CANDIDATES", {b: configs[:1] for b, configs in fp8_gemv.CANDIDATES.items()})
    offered: list[object] = []

    def timer(call, device: torch.device) -> float:
        candidate = getattr(call, "args", (None,))[0]
        offered.append(candidate)
        return 1e-6 if candidate is int8_w8a8.INT8_ROWS else 1e-3

    monkeypatch.setattr(kernel_choice, "time_gpu", timer)
    monkeypatch.setattr(kernel_choice, "time_call", timer)
    parts = int8_parts(48, 64, group, seed=5)
    parts.int8_rows = int8_rows
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    caplog.set_level(logging.INFO, logger=fp8_gemv.__name__)
    serves = int8_rows and group == 0
    for rows, size in ((1, 1), (3, 4), (17, 64), (300, 1024)):
        x = torch.randn(rows, 64)
        want = (int8_w8a8.INT8_ROWS.quantized(x) if serves else x) @ parts.dequantize().t()
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(quantized_linear(x, layer.weight, layer.scales), want, rtol=1e-5, atol=1e-5)
        key = (CPU, 48, 64, size, torch.float32, 2 if group else 0, False, torch.int8, int8_rows)
        assert fp8_gemv.chosen()[key] is (int8_w8a8.INT8_ROWS if serves else None)
    assert (int8_w8a8.INT8_ROWS in offered) is serves
    assert ("run on cuBLAS int8 x int8, activations per row" in caplog.text) is serves


@pytest.mark.skipif(not int4_available(), reason="the CPU's q8 kernel (numba) is not available")
@pytest.mark.parametrize(
    ("out", "group", "zero", "q8_group"),
    [
        (32, 0, 128, 32),  # W8A8's scale a channel: over groups of 32
        (32, 32, 128, 32),  # GPTQ-Int8's, W8A16's groups (128 in Qwen's releases)
        (32, 48, 128, 16),  # groups of 48: 3 of 16
        (32, 24, 128, None),  # groups of 24: no kernel group divides them
        (32, 32, 130, None),  # asymmetric codes
        (40, 32, 128, None),  # outputs not whole blocks of 16 rows (the fast path would not take the model)
    ],
    ids=["channel", "g32", "g48", "g24", "asymmetric", "out-40"],
)
def test_a_cpu_computing_in_fp32_keeps_symmetric_codes_on_the_q8_kernel(
    out: int, group: int, zero: int, q8_group: int | None
) -> None:
    """`cpu_codes.q8_layer`: symmetric 8-bit codes whose groups are runs of a multiple of 16 inputs (or a scale a
    channel) keep their codes on the q8 kernel, each group's scale over its kernel groups (a quarter of fp32's bytes;
    exact); the rest de-quantized at load, as before."""
    parts = int8_parts(out, 96, group, seed=7, zero=zero)
    bias = torch.randn(out)
    layer = int8_module(parts, bias, torch.float32, CPU)
    assert type(layer) is (torch.nn.Linear if q8_group is None else Q8Linear)
    assert torch.equal(weight_of(layer), parts.dequantize()) and torch.equal(layer.bias, bias)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ parts.dequantize().t() + bias, rtol=1e-5, atol=1e-5)
    if q8_group is not None:
        assert str(layer).endswith(f"q8 weights (groups of {q8_group}))")
