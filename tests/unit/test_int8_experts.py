"""A mixture of experts' 8-bit experts kept as codes (engine/model/int8_experts.py): `fp8_experts`' grouped kernel
reading int8 codes (under Triton's interpreter on a CPU, on the GPU in the GPU check), and GPTQ-Int8 and
compressed-tensors' W8A16 and W8A8 Qwen3-MoE and Mixtral checkpoints loaded with their experts' codes kept and served
with the tokens of their de-quantized model, on one device and over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from helpers.kept_experts import DEVICE, kernel_runs, moe, on_cpu_only
from helpers.llama_variants import MOE_ARCHS, build
from lmiserve.engine.model import fp8_experts, fp8_gemv, grouped_experts, int8_experts

needs_kernel = kernel_runs(fp8_gemv.available())


@pytest.fixture
def on_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped products on the Triton kernel here (a CPU's tensors under the interpreter)."""
    monkeypatch.setattr(fp8_experts, "INTERPRETED_ON_CPU", True)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 3, 0, 4], [5, 17, 0, 1], [40, 0, 30, 2]])
@pytest.mark.parametrize("group", [0, 32, 128], ids=["per-channel", "groups-of-32", "groups-of-128"])
@needs_kernel
def test_the_grouped_product_of_int8_codes_is_each_experts_dequantized_product(
    on_kernel: None, counts: list[int], group: int
) -> None:
    """Rows sorted by expert, each row's product with its expert's int8 codes (all of -128..127) times their
    channel's or group's scale: what de-quantizing each expert's weight gives, in fp32 and in fp16 (and bf16 on a
    GPU); an expert's rows past a tile too."""
    gen = torch.Generator().manual_seed(len(counts) + sum(counts) + group)
    codes = torch.randint(-128, 128, (4, 96, 256), generator=gen, dtype=torch.int8).to(DEVICE)
    shape = (4, 96, 256 // group) if group else (4, 96)
    scales = (torch.rand(*shape, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    rows = sum(counts)
    tallies = torch.tensor(counts, device=DEVICE)
    halves = (torch.float16,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
    fp32 = 1e-5 if DEVICE.type == "cpu" else 5e-3  # (a GPU's fp32 dot: tf32)
    for dtype, tolerance in ((torch.float32, fp32), *((half, 2e-2) for half in halves)):
        x = torch.randn(rows, 256, generator=gen).to(DEVICE, dtype)
        got = fp8_experts.grouped_product(x, codes, scales, tallies)
        want = fp8_experts.dequantized_product(x.float(), codes, scales, tallies)
        assert got.dtype == dtype and got.shape == (rows, 96)
        assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), dtype


def test_a_cpu_keeps_the_codes_in_fp32_and_bf16() -> None:
    """On a CPU the codes are kept (on its q8 kernel: `cpu_experts`) whether it computes in fp32 or in bf16."""
    model = build(*MOE_ARCHS["qwen3_moe"])
    assert int8_experts.kept_for(model, torch.device("cpu"), "tiny")
    assert int8_experts.kept_for(model.to(torch.bfloat16), torch.device("cpu"), "tiny")


# (architecture, format, group): Qwen's GPTQ-Int8 (symmetric, groups of 32), one group a row (64 of 64 inputs), a
# Mixtral (w1-w3), llm-compressor's W8A16 (packed, by groups) and W8A8 (int8 codes by channel, int8 activations)
CHECKPOINTS = {
    "qwen3-gptq-int8-g32": ("qwen3_moe", "gptq-int8", 32),
    "qwen3-gptq-int8-row": ("qwen3_moe", "gptq-int8", 64),
    "mixtral-gptq-int8-g32": ("mixtral", "gptq-int8", 32),
    "qwen3-w8a16-g32": ("qwen3_moe", "w8a16", 32),
    "qwen3-w8a8-channel": ("qwen3_moe", "w8a8", 0),
}


@on_cpu_only
@pytest.mark.parametrize("case", list(CHECKPOINTS))
@needs_kernel
def test_an_8bit_mixture_of_experts_kept_int8_serves_its_dequantized_models_tokens(
    tiny_model, tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, on_kernel: None, case: str
) -> None:
    """An 8-bit MoE checkpoint loaded where its experts keep their codes (as on a GPU where de-quantized they would
    not fit: `int8_experts.kept_for` forced): every experts module holds each expert's signed codes with its
    channels' or groups' scales, whose product is the checkpoint's de-quantized weight exactly, the start's account
    says so, and the engine on the fast path, its decode steps in the decode graphs (played on a CPU), gives the
    greedy tokens of the same checkpoint de-quantized at load (fp32)."""
    from helpers.kept_experts import load_both, serve_counted
    from helpers.quantizable import write_checkpoint

    arch, fmt, group = CHECKPOINTS[case]
    write_checkpoint(moe(arch), tmp_path, fmt, group)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    dequantized, loaded, record, lines = load_both(tmp_path, monkeypatch, caplog, int8_experts)
    kept = [m for m in loaded.model.modules() if grouped_experts.kept(m, "fp8")]
    assert len(kept) == sum(1 for n, _ in loaded.model.named_modules() if n.endswith(".experts")) > 0
    assert any("experts modules kept int8" in line for line in lines), lines
    reference = dequantized.model.model.layers[1].mlp.experts
    experts = loaded.model.model.layers[1].mlp.experts
    inputs = experts.down_proj.shape[2]
    per_channel = fmt == "w8a8" or group == inputs
    assert experts.gate_up_proj.dtype == torch.int8
    assert experts.down_proj_scales.shape[2:] == (() if per_channel else (inputs // group,))
    for kind in ("gate_up_proj", "down_proj"):
        codes, scales = getattr(experts, kind), getattr(experts, f"{kind}_scales")
        for e in (0, codes.shape[0] - 1):  # (the de-quantized load's values: the published unpacking's)
            assert torch.equal(fp8_gemv.dequantized_weight(codes[e], scales[e]), getattr(reference, kind)[e]), kind

    engine, ran = serve_counted(loaded, dequantized, monkeypatch, fp8_experts)
    assert engine.runner.path == "fast" and ran and record.steps


@on_cpu_only
@needs_kernel
def test_asymmetric_8bit_experts_are_dequantized(tiny_model, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes the kernel does not read (W8A16 with zero points: not symmetric) stay de-quantized where kept would be
    asked for, and load with the values of the checkpoint de-quantized."""
    from helpers.quantizable import write_checkpoint
    from lmiserve.models.load import load_causal_lm

    write_checkpoint(moe("qwen3_moe"), tmp_path, "w8a16-asym", 32)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    dequantized = load_causal_lm(tmp_path, dtype="fp32", device="cpu")
    monkeypatch.setattr(int8_experts, "kept_for", lambda model, device, name: True)
    loaded = load_causal_lm(tmp_path, dtype="fp32", device="cpu")
    experts = loaded.model.model.layers[1].mlp.experts
    assert not grouped_experts.kept(experts) and experts.down_proj.dtype == torch.float32
    assert torch.equal(experts.down_proj, dequantized.model.model.layers[1].mlp.experts.down_proj)


@on_cpu_only
@pytest.mark.parametrize(
    ("fmt", "inter", "group", "world", "pads"),
    [
        ("gptq-int8", 128, 32, 2, [(0, 0), (0, 0)]),  # 64 inputs a rank: whole groups of 32
        ("gptq-int8", 96, 32, 2, [(0, 16), (16, 0)]),  # 48 a rank: 0-48 kept as 0-64, 48-96 as 32-96
        ("gptq-int8", 96, 32, 4, [(0, 8), (24, 16), (16, 24), (8, 0)]),  # 24 a rank
        ("w8a16", 96, 32, 2, [(0, 16), (16, 0)]),  # (compressed-tensors' groups, from its config)
        ("w8a8", 96, 0, 2, [(0, 0), (0, 0)]),  # a scale a channel: any part
    ],
)
@needs_kernel
def test_each_tensor_parallel_rank_keeps_its_part_of_the_8bit_experts(
    tmp_path, monkeypatch: pytest.MonkeyPatch, on_kernel: None, fmt: str, inter: int, group: int, world: int, pads: list
) -> None:
    """Over two and four ranks each rank reads its part of every expert's 8-bit matrices (gate/up's rows, down's
    inputs) with their scales, kept int8: the ranks' MoE blocks (what the all-reduce adds) are the block of the
    checkpoint de-quantized whole in one process. Where a rank's inputs of down_proj are not whole groups it keeps
    the whole groups that cover them and pads its activations with zeros (`pads`); with a scale a channel any part
    of the inputs is kept as it is."""
    from helpers.kept_experts import assert_ranks_sum, assert_widened, rank_blocks
    from helpers.quantizable import write_checkpoint

    model = moe("qwen3_moe", {"moe_intermediate_size": inter})
    write_checkpoint(model, tmp_path, fmt, group)
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, int8_experts, world):
        assert_widened(parts, "fp8", pads, inter // world)
        assert all(part.experts.down_proj.dtype == torch.int8 for part in parts)
        assert_ranks_sum(block, parts, model.config.hidden_size)
