"""GPTQ's act-order (``desc_act``) weights kept as codes (`input_order`): their inputs stored sorted by group, the
activations gathered in that order. On a CPU the 4-bit codes run the int4 kernel (`Int4Linear`) where they were
de-quantized to fp32 (8 times the bytes); 8-bit codes kept on a GPU run `fp8_gemv`'s kernel (`Int8WeightLinear`, here
under Triton's interpreter). The engine's greedy tokens over such a checkpoint equal transformers' over its
de-quantized weights: test_quantized_checkpoints.py's ``gptq-g64-desc-act``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers.packed_steps import packed_and_op_by_op_give_transformers_logits
from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.model.input_order import InputOrder, in_group_order
from lmiserve.engine.model.int8_weights import Int8WeightLinear
from lmiserve.engine.model.llama_layout import fused_layers
from lmiserve.engine.model.quant_formats import Int4Parts, int4_module, int8_module
from lmiserve.engine.model.quantize import Int4Linear, Q8Linear, int4_available, quantized_linear
from lmiserve.models.load import load_causal_lm

CPU = torch.device("cpu")
needs_int4 = pytest.mark.skipif(not int4_available(), reason="the CPU int4 kernel (numba) is not available")
interpreted = pytest.mark.skipif(
    not fp8_gemv.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU)",
)


def act_order_parts(out: int, inputs: int, group: int, bits: int = 4, seed: int = 0) -> Int4Parts:
    """Random codes whose inputs' groups are scattered as GPTQ's act-order scatters them (each group `group` inputs);
    8-bit codes symmetric (zero 128), as GPTQ-Int8's."""
    generator = torch.Generator().manual_seed(seed)
    groups = inputs // group
    codes = torch.randint(0, 2**bits, (out, inputs), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(out, groups, generator=generator) * 0.05 + 1e-3).half().float()  # (fp16 scales, as stored)
    zero = torch.randint(0, 16, (out, groups), generator=generator, dtype=torch.int32) if bits == 4 else None
    g_idx = (torch.arange(inputs) // group)[torch.randperm(inputs, generator=generator)]
    return Int4Parts(
        codes, scale, torch.full_like(scale, 128, dtype=torch.int32) if zero is None else zero, g_idx, bits
    )


def test_the_inputs_are_sorted_by_group_where_that_makes_runs_of_one_size() -> None:
    parts = act_order_parts(8, 256, 64)
    assert parts.group_size() is None  # scattered: no kernel reads it as it is
    ordered, order, size = in_group_order(parts)
    assert order is not None and size == ordered.group_size() == 64
    assert torch.equal(ordered.g_idx, torch.arange(256) // 64)
    assert torch.equal(ordered.codes, parts.codes[:, order])
    in_order = act_order_parts(8, 256, 64)
    in_order.g_idx = torch.arange(256) // 64
    kept, none, size = in_group_order(in_order)
    assert kept is in_order and none is None and size == 64  # already runs: nothing to gather
    uneven = act_order_parts(8, 256, 64)
    uneven.g_idx, uneven.codes = uneven.g_idx[:96], uneven.codes[:, :96]  # a rank's part: groups of unequal sizes
    kept, none, size = in_group_order(uneven)
    assert kept is uneven and none is None and size is None


@needs_int4
@pytest.mark.parametrize("group", [32, 64, 128])
def test_act_order_4_bit_codes_run_the_cpu_int4_kernel_with_the_checkpoints_weights(group: int) -> None:
    """Where they were de-quantized to fp32: an `Int4Linear` whose weight, de-quantized, is the checkpoint's exactly
    (in its inputs' order) and whose product is the de-quantized weight's."""
    parts = act_order_parts(48, 256, group, seed=group)
    bias = torch.randn(48)
    layer = int4_module(parts, bias, torch.float32, CPU)
    assert isinstance(layer, Int4Linear) and layer.order is not None
    assert torch.equal(layer.dequantized(), parts.dequantize())
    assert str(layer).endswith("int4 weights (groups of 32, inputs in group order))")
    x = torch.randn(5, 256)
    torch.testing.assert_close(layer(x), x @ parts.dequantize().t() + bias, rtol=1e-5, atol=1e-4)
    uneven = act_order_parts(48, 256, group, seed=group)
    uneven.g_idx, uneven.codes = uneven.g_idx[:96], uneven.codes[:, :96]
    assert type(int4_module(uneven, None, torch.float32, CPU)) is torch.nn.Linear  # (as before: de-quantized)


@interpreted
def test_act_order_8_bit_codes_kept_on_a_gpu_run_the_kernel_on_gathered_rows() -> None:
    parts = act_order_parts(32, 128, 32, bits=8, seed=3)
    layer = int8_module(parts, None, torch.float32, CPU, keep_codes=True)
    assert isinstance(layer, Int8WeightLinear) and layer.order is not None
    assert torch.equal(layer.dequantized(), parts.dequantize())
    assert str(layer).endswith("scales by groups of 32 inputs, inputs in group order))")
    x = torch.randn(3, 128)
    want = x @ parts.dequantize().t()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    scales = InputOrder(layer.scales, layer.order)  # as the fast path passes a fused product's
    torch.testing.assert_close(quantized_linear(x, layer.weight, scales), want, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def desc_act_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPTQ checkpoints with act-order, 4-bit and 8-bit, of one model."""
    model = quantizable_llama(39)
    with torch.no_grad():  # norms' weights other than ones (the packed kernels take them in the gathered order)
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
    root = tmp_path_factory.mktemp("desc-act")
    return {fmt: write_checkpoint(model, root / fmt, fmt, 64, True) for fmt in ("gptq", "gptq-int8")}


@needs_int4
@pytest.mark.parametrize(("fmt", "kind"), [("gptq", Int4Linear), ("gptq-int8", Q8Linear)])
@torch.inference_mode()
def test_the_fast_path_fuses_layers_of_one_order_and_gives_transformers_logits(
    desc_act_folders: dict[str, Path], fmt: str, kind: type
) -> None:
    """q/k/v (and gate/up) read one input and GPTQ gives them one order: one product each, its scales with the
    order; the steps (a prompt chunk, then decode rows) give the logits of transformers' forward over the same
    modules, through the packed int4/q8 kernels (q4_decode: each input gathered, the norms' weights in that order)
    and through the op-by-op layers. 4-bit codes on the int4 kernel; GPTQ-Int8's on the q8 kernel."""
    model = load_causal_lm(desc_act_folders[fmt], device="cpu").model
    linears = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert linears and all(isinstance(m, kind) and m.order is not None for m in linears)
    layer, attn = fused_layers(model)[0], model.model.layers[0].self_attn
    assert layer.fused and isinstance(layer.qkv_s, InputOrder) and torch.equal(layer.qkv_s.order, attn.q_proj.order)
    assert isinstance(layer.down_s, InputOrder) and isinstance(layer.gate_up_s, InputOrder)
    packed_and_op_by_op_give_transformers_logits(model)


@needs_int4
@pytest.mark.parametrize("fmt", ["gptq", "gptq-int8"])
@torch.inference_mode()
def test_layers_of_other_orders_are_products_apart(desc_act_folders: dict[str, Path], fmt: str) -> None:
    """A v_proj whose inputs came in another order (a checkpoint quantized linear by linear) is not fused with q and
    k: q/k one product, v its own, each gathering its order (4-bit codes, and GPTQ-Int8's on the q8 kernel)."""
    model = load_causal_lm(desc_act_folders[fmt], device="cpu").model
    attn = model.model.layers[1].self_attn
    v = attn.v_proj
    other = act_order_parts(v.out_features, v.in_features, 64, bits=4 if fmt == "gptq" else 8, seed=11)
    attn.v_proj = int4_module(other, None, torch.float32, CPU)
    assert not torch.equal(attn.v_proj.order, attn.q_proj.order)
    seq = [4, 60, 2, 11, 8, 30]
    reference = model(torch.tensor([seq])).logits[0]
    fast = FastLlama(model, paged_cache(model, 4, 4), 128)
    assert fast.packed is None  # (its layers are one product each)
    parts = fused_layers(model)[1].qkv
    assert [p.outputs for p in parts] == [attn.q_proj.out_features + attn.k_proj.out_features, v.out_features]
    out = fast.forward(StepInputs(chunks=[([1, 0], 0, seq)], keep=[*range(len(seq))]))
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@needs_int4
@pytest.mark.parametrize(("bits", "kind"), [(4, "Int4Linear"), (8, "Q8Linear")])
def test_the_benchmark_reports_the_kept_codes_against_the_de_quantized_weights(
    tmp_path: Path, bits: int, kind: str
) -> None:
    """benchmarks/act_order_cpu.py on a small shape: the act-order linears kept as codes (as few bytes as the in-order
    checkpoint's: 4-bit on the int4 kernel, GPTQ-Int8's on the q8 kernel) where before they were fp32, with the
    de-quantized weights' greedy tokens."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "act-order.json"
    command = [sys.executable, str(root / "benchmarks/act_order_cpu.py"), "--hidden", "256", "--intermediate", "512"]
    command += ["--bits", str(bits), "--layers", "1", "--steps", "3", "--rows", "1,2", "--json", str(out)]
    subprocess.run(command, check=True)
    results = json.loads(out.read_text())
    now, before, in_order = results["served"].values()
    assert now["linears"] == {f"{kind} (inputs in group order)": 7} and before["linears"] == {"Linear": 7}
    assert in_order["linears"] == {kind: 7} and now["linear_mib"] == in_order["linear_mib"]
    assert now["linear_mib"] < before["linear_mib"] / (4 if bits == 4 else 3)
    assert all(now[f"step_ms_{n}_rows"] > 0 for n in (1, 2))
    assert all(v["same_greedy_tokens"] for v in results["act_order_vs_dequantized"].values())
