"""gpt-oss's MXFP4 experts kept MXFP4 (engine/model/mxfp4_experts.py): the grouped product's Triton kernel (under
Triton's interpreter on a CPU, on the GPU in the GPU check), and an MXFP4 gpt-oss checkpoint as OpenAI publishes it
loaded with its experts kept and served with the tokens of the model transformers de-quantizes."""

from __future__ import annotations

import pytest
import torch

from helpers.kept_experts import DEVICE, kernel_runs
from lmiserve.engine.model import grouped_experts, mxfp4_experts

needs_kernel = kernel_runs(mxfp4_experts.triton is not None)


@pytest.fixture
def on_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped products on the Triton kernel here (a CPU's tensors under the interpreter)."""
    monkeypatch.setattr(mxfp4_experts, "INTERPRETED_ON_CPU", True)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 3, 0, 4], [5, 17, 0, 1], [40, 0, 30, 2]])
@pytest.mark.parametrize("inputs", [192, 96], ids=["steps-of-64", "steps-of-32"])
@needs_kernel
def test_the_grouped_product_is_each_experts_dequantized_product(
    on_kernel: None, counts: list[int], inputs: int
) -> None:
    """Rows sorted by expert (experts without rows between them), each row's product with its expert's 4-bit floats
    times their blocks' powers of two, 64 inputs a step or 32 (inputs not a multiple of 64): what de-quantizing each
    expert's weight gives, in fp32 and in fp16 (and bf16 on a GPU: Triton's interpreter has no bf16 dot)."""
    gen = torch.Generator().manual_seed(sum(counts) + inputs)
    blocks = torch.randint(0, 256, (4, 96, inputs // 2), generator=gen).to(torch.uint8).to(DEVICE)
    scales = torch.randint(118, 130, (4, 96, inputs // 32), generator=gen).to(torch.uint8).to(DEVICE)
    rows = sum(counts)
    tallies = torch.tensor(counts, device=DEVICE)
    halves = (torch.float16,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
    fp32 = 1e-5 if DEVICE.type == "cpu" else 5e-3  # (a GPU's fp32 dot: tf32)
    for dtype, tolerance in ((torch.float32, fp32), *((half, 2e-2) for half in halves)):
        x = torch.randn(rows, inputs, generator=gen).to(DEVICE, dtype)
        got = mxfp4_experts.grouped_product(x, blocks, scales, tallies)
        want = mxfp4_experts.dequantized_product(x.float(), blocks, scales, tallies)
        assert got.dtype == dtype and got.shape == (rows, 96)
        assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), dtype


def test_on_a_cpu_the_experts_are_kept_in_fp32_and_bf16_and_only_gpt_oss_layout_is_served() -> None:
    """On a CPU the MXFP4 experts are kept (on its f4 kernel: tests/unit/test_cpu_experts.py) whether it computes in
    fp32 or in bf16."""
    from helpers.llama_variants import MOE_ARCHS, build

    gpt_oss = build(*MOE_ARCHS["gpt_oss"])
    assert mxfp4_experts.kept_for(gpt_oss, torch.device("cpu"), "tiny")
    assert mxfp4_experts.kept_for(gpt_oss.to(torch.bfloat16), torch.device("cpu"), "tiny")
    assert mxfp4_experts.servable(gpt_oss.model.layers[0].mlp.experts)
    qwen3 = build(*MOE_ARCHS["qwen3_moe"])
    assert not mxfp4_experts.servable(qwen3.model.layers[0].mlp.experts)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter; the kernel test covers CUDA")
@needs_kernel
def test_an_mxfp4_gpt_oss_kept_mxfp4_serves_its_dequantized_models_tokens(
    tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, on_kernel: None
) -> None:
    """gpt-oss's MXFP4 checkpoint loaded where its experts stay MXFP4 (as on a GPU where de-quantized they would not
    fit: `mxfp4_experts.kept_for` forced): every experts module holds the stored bytes and powers, which de-quantize to
    exactly what transformers makes of them, its biases kept; the start's account says so; and the engine on the fast
    path, its decode steps in the decode graphs (played on a CPU, watched for host syncs), gives the greedy tokens of
    the model transformers de-quantizes (fp32)."""
    from safetensors.torch import load_file

    from helpers.kept_experts import load_both, serve_counted
    from helpers.mxfp4 import write_mxfp4_gpt_oss
    from lmiserve.engine.model.layout_variants import moe_block, moe_forward

    state = write_mxfp4_gpt_oss(tmp_path)
    dequantized, loaded, record, lines = load_both(tmp_path, monkeypatch, caplog, mxfp4_experts)
    assert any("2 experts modules kept MXFP4" in line for line in lines), lines
    stored = load_file(tmp_path / "model.safetensors")
    for i, layer in enumerate(loaded.model.model.layers):
        experts = layer.mlp.experts
        assert grouped_experts.kept(experts, "mxfp4")
        for kind in mxfp4_experts.KINDS:
            at = f"model.layers.{i}.mlp.experts.{kind}"
            blocks, scales = getattr(experts, kind), getattr(experts, f"{kind}_scales")
            assert torch.equal(blocks, stored[f"{at}_blocks"].flatten(2))
            assert torch.equal(scales, stored[f"{at}_scales"])
            for e in range(blocks.shape[0]):  # ([experts, in, out] as transformers holds them)
                weight = mxfp4_experts.dequantized_weight(blocks[e], scales[e])
                assert torch.equal(weight.t(), state[f"{at}"][e]), (kind, e)
            assert torch.equal(getattr(experts, f"{kind}_bias"), state[f"{at}_bias"])
    x = torch.randn(7, loaded.model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():  # each MoE block's output, the biases' small part included (the tokens miss it)
        for kept_layer, layer in zip(loaded.model.model.layers, dequantized.model.model.layers, strict=True):
            got, want = (moe_forward(moe_block(one), x) for one in (kept_layer, layer))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    held = dict(loaded.model.named_parameters())  # everything else as transformers loads it (fp32 norms included)
    for name, value in dequantized.model.named_parameters():
        if ".experts." not in name:
            assert held[name].dtype == value.dtype and torch.equal(held[name], value), name
    engine, ran = serve_counted(loaded, dequantized, monkeypatch, mxfp4_experts)
    assert engine.runner.path == "fast" and record.steps and ran


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter; the kernel test covers CUDA")
@pytest.mark.parametrize(
    ("intermediate", "world", "pads"),
    [
        (64, 2, [(0, 0), (0, 0)]),  # 32 inputs a rank: whole blocks
        (96, 2, [(0, 16), (16, 0)]),  # 48 a rank: inputs 0-48 kept as 0-64, 48-96 as 32-96
        (96, 4, [(0, 8), (24, 16), (16, 24), (8, 0)]),  # 24 a rank (gpt-oss-120b's 2880 over 4 and 8 ranks)
    ],
)
@needs_kernel
def test_each_tensor_parallel_rank_keeps_its_part_of_the_mxfp4_experts(
    tmp_path, monkeypatch: pytest.MonkeyPatch, on_kernel: None, intermediate: int, world: int, pads: list
) -> None:
    """Over two and four ranks each rank reads its part of gpt-oss's MXFP4 experts (gate/up's outputs, interleaved
    pairs; down's inputs) with their blocks' powers, kept MXFP4, and its part of the biases (down's on rank 0 alone):
    the ranks' MoE blocks (what the all-reduce adds) are the block transformers de-quantizes whole in one process.
    Where a rank's inputs of down_proj are not whole blocks of 32, it keeps the whole blocks that cover them and pads
    its activations with zeros (`pads`: before, after), so its neighbours' inputs in those blocks add nothing."""
    from helpers.kept_experts import assert_ranks_sum, assert_widened, rank_blocks
    from helpers.llama_variants import MOE_ARCHS, build
    from helpers.mxfp4 import write_mxfp4_gpt_oss

    write_mxfp4_gpt_oss(tmp_path, intermediate)
    config_class, model_class, overrides = MOE_ARCHS["gpt_oss"]
    model = build(config_class, model_class, {**overrides, "intermediate_size": intermediate})
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, mxfp4_experts, world):
        assert_widened(parts, "mxfp4", pads, intermediate // world, 2)
        assert all(part.experts.gate_up_proj.shape[1] == 2 * intermediate // world for part in parts)
        assert_ranks_sum(block, parts, model.config.hidden_size)
