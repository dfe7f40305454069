"""A mixture of experts' 4-bit experts kept 4-bit (engine/model/int4_experts.py): the grouped product's Triton kernel
(under Triton's interpreter on a CPU, on the GPU in the GPU check), and AWQ, GPTQ and compressed-tensors' W4A16
Qwen3-MoE and Mixtral checkpoints loaded with their experts' codes kept and served with the tokens of their
de-quantized model, on one device and over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from helpers.kept_experts import DEVICE, kernel_runs, moe, on_cpu_only
from helpers.llama_variants import MOE_ARCHS, build
from lmiserve.engine.model import grouped_experts, int4_experts, int4_triton

needs_kernel = kernel_runs(int4_triton.available())


@pytest.fixture
def on_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped products on the Triton kernel here (a CPU's tensors under the interpreter)."""
    monkeypatch.setattr(int4_experts, "INTERPRETED_ON_CPU", True)


def _experts(experts: int, outputs: int, inputs: int, group: int, gen: torch.Generator):
    """Random 4-bit experts as `int4_experts.keep` holds them: words, scales, zeros (steps, not all 8)."""
    codes = torch.randint(0, 16, (experts, outputs, inputs // 8, 8), generator=gen)
    words = int4_triton.pack_nibbles(codes)
    scales = torch.rand(experts, inputs // group, outputs, generator=gen) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (experts, inputs // group, outputs), generator=gen).float()
    return words.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 3, 0, 4], [5, 17, 0, 1], [40, 0, 30, 2]])
@pytest.mark.parametrize(("group", "act_order"), [(32, False), (64, False), (256, False), (64, True)])
@needs_kernel
def test_the_grouped_product_is_each_experts_dequantized_product(
    on_kernel: None, counts: list[int], group: int, act_order: bool
) -> None:
    """Rows sorted by expert (experts without rows between them), each row's product with its expert's 4-bit codes
    less their group's zero times its scale, groups of 32, 64 and 256 inputs (tiles of 32, 64 and 128 inputs), and
    with GPTQ's act-order (each expert's stored inputs some order of the rows' columns): what de-quantizing each
    expert's weight gives, in fp32 and in fp16 (and bf16 on a GPU: Triton's interpreter has no bf16 dot); an expert's
    rows past 16 (a tile) too."""
    gen = torch.Generator().manual_seed(len(counts) + sum(counts) + group)
    words, scales, zeros = _experts(4, 96, 256, group, gen)
    order = torch.stack([torch.randperm(256, generator=gen) for _ in range(4)]).int().to(DEVICE) if act_order else None
    rows = sum(counts)
    tallies = torch.tensor(counts, device=DEVICE)
    halves = (torch.float16,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())
    fp32 = 1e-5 if DEVICE.type == "cpu" else 5e-3  # (a GPU's fp32 dot: tf32)
    for dtype, tolerance in ((torch.float32, fp32), *((half, 2e-2) for half in halves)):
        x = torch.randn(rows, 256, generator=gen).to(DEVICE, dtype)
        got = int4_experts.grouped_product(x, words, scales, zeros, tallies, order)
        want = int4_experts.dequantized_product(x.float(), words, scales, zeros, tallies, order)
        assert got.dtype == dtype and got.shape == (rows, 96)
        assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), dtype


def test_a_cpu_keeps_the_codes_in_fp32_and_bf16() -> None:
    """On a CPU the codes are kept (on its q4 kernel: `cpu_experts`) whether it computes in fp32 or in bf16."""
    model = build(*MOE_ARCHS["qwen3_moe"])
    assert int4_experts.kept_for(model, torch.device("cpu"), "tiny")
    assert int4_experts.kept_for(model.to(torch.bfloat16), torch.device("cpu"), "tiny")


# (architecture, format, group, act-order): AutoAWQ's and GPTQModel's Qwen3-MoE, an AWQ Mixtral (w1-w3), llm-compressor's
# W4A16 (symmetric and not, and one group a row), GPTQ with act-order; GPTQ's 8-bit codes are not this kernel's
# (int8_experts': test_int8_experts.py)
CHECKPOINTS = {
    "qwen3-awq-g32": ("qwen3_moe", "awq", 32, False),
    "qwen3-gptq-g64": ("qwen3_moe", "gptq", 64, False),
    "qwen3-w4a16-g32": ("qwen3_moe", "w4a16", 32, False),
    "qwen3-w4a16-asym-channel": ("qwen3_moe", "w4a16-asym", 0, False),
    "mixtral-awq-g32": ("mixtral", "awq", 32, False),
    "qwen3-gptq-act-order": ("qwen3_moe", "gptq", 32, True),
    "qwen3-gptq-int8": ("qwen3_moe", "gptq-int8", 32, False),
}


@on_cpu_only
@pytest.mark.parametrize("case", list(CHECKPOINTS))
@needs_kernel
def test_a_4bit_mixture_of_experts_kept_4bit_serves_its_dequantized_models_tokens(
    tiny_model, tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, on_kernel: None, case: str
) -> None:
    """A 4-bit MoE checkpoint loaded where its experts keep their codes (as on a GPU where de-quantized they would
    not fit: `int4_experts.kept_for` forced): every experts module holds each expert's codes as the checkpoint's
    unpacking gives them, with its groups' scales and zeros, the start's account says so, and the engine on the fast
    path, its decode steps in the decode graphs (played on a CPU, watched for host syncs), gives the greedy tokens of
    the same checkpoint de-quantized at load (fp32); with GPTQ's act-order each expert's order of inputs kept beside its
    codes. 8-bit codes are not this kernel's (here de-quantized), and serve."""
    from helpers.kept_experts import load_both, serve_counted
    from helpers.quantizable import write_checkpoint

    arch, fmt, group, act_order = CHECKPOINTS[case]
    write_checkpoint(moe(arch), tmp_path, fmt, group, act_order=act_order)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    dequantized, loaded, record, lines = load_both(tmp_path, monkeypatch, caplog, int4_experts)
    kept = [m for m in loaded.model.modules() if grouped_experts.kept(m, "int4")]
    servable = fmt != "gptq-int8"
    assert len(kept) == (sum(1 for n, _ in loaded.model.named_modules() if n.endswith(".experts")) if servable else 0)
    assert any("experts modules kept 4-bit" in line for line in lines) == servable
    if servable:
        reference = dequantized.model.model.layers[1].mlp.experts
        experts = loaded.model.model.layers[1].mlp.experts
        assert experts.gate_up_proj.dtype == torch.int32 and experts.down_proj_zeros.dtype == torch.float32
        assert experts.down_proj_scales.shape[1] == (1 if group == 0 else experts.down_proj.shape[2] * 8 // group)
        for kind in ("gate_up_proj", "down_proj"):
            words, scales, zeros = (getattr(experts, f"{kind}{suffix}") for suffix in int4_experts.PARTS[:3])
            order = getattr(experts, f"{kind}_order", None)
            assert (order is not None) == act_order
            for e in (0, words.shape[0] - 1):  # (the de-quantized load's values: the published unpacking's)
                got = int4_experts.dequantized_weight(
                    words[e], scales[e], zeros[e], None if order is None else order[e]
                )
                assert torch.equal(got, getattr(reference, kind)[e]), (kind, e)

    engine, ran = serve_counted(loaded, dequantized, monkeypatch, int4_experts)
    assert engine.runner.path == "fast" and bool(ran) == servable and record.steps


@on_cpu_only
@pytest.mark.parametrize(
    ("fmt", "inter", "world", "pads"),
    [
        ("awq", 128, 2, [(0, 0), (0, 0)]),  # 64 inputs a rank: whole groups of 32
        ("awq", 96, 2, [(0, 16), (16, 0)]),  # 48 a rank: 0-48 kept as 0-64, 48-96 as 32-96
        ("awq", 96, 4, [(0, 8), (24, 16), (16, 24), (8, 0)]),  # 24 a rank
        ("w4a16", 96, 2, [(0, 16), (16, 0)]),  # (compressed-tensors' groups, from its config)
        ("gptq-act-order", 128, 2, None),  # (act-order: whole rows only)
    ],
)
@needs_kernel
def test_each_tensor_parallel_rank_keeps_its_part_of_the_4bit_experts(
    tmp_path, monkeypatch: pytest.MonkeyPatch, on_kernel: None, fmt: str, inter: int, world: int, pads: list | None
) -> None:
    """Over two and four ranks each rank reads its part of every expert's AWQ matrices (gate/up's rows, down's
    inputs) with their groups' scales and zeros (groups of 32), kept 4-bit: the ranks' MoE blocks (what the
    all-reduce adds) are the block of the checkpoint de-quantized whole in one process. Where a rank's inputs of
    down_proj are not whole groups it keeps the whole groups that cover them and pads its activations with zeros
    (`pads`); a part of GPTQ's act-order inputs is de-quantized instead (`pads` None), and the sum is the same."""
    from helpers.kept_experts import assert_ranks_sum, assert_widened, rank_blocks
    from helpers.quantizable import write_checkpoint

    model = moe("qwen3_moe", {"moe_intermediate_size": inter})
    write_checkpoint(model, tmp_path, fmt.removesuffix("-act-order"), 32, act_order=fmt.endswith("-act-order"))
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, int4_experts, world):
        assert_widened(parts, "int4", pads, inter // world, 8)
        assert_ranks_sum(block, parts, model.config.hidden_size)


def test_the_decode_graphs_capture_4bit_experts_in_any_dtype(tmp_path, on_kernel: None) -> None:
    """torch's grouped product waits for the device outside bf16 (`experts_graph_reason`); the 4-bit experts' kernel
    finds its tiles on the device, so a model whose experts all keep their codes is captured in fp32 too."""
    from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
    from lmiserve.engine.model.fast_llama import FastLlama
    from lmiserve.engine.model.layout_variants import experts_graph_reason

    model = moe("qwen3_moe")
    cfg = model.config
    cache = PagedKVCache(
        cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, AttentionShape.of(cfg).head_dim, torch.float32, "cpu"
    )
    fast = FastLlama(model, cache, 64)
    assert "float32" in (experts_graph_reason(model, fast.layers) or "")
    gen = torch.Generator().manual_seed(0)
    for module in (m for n, m in model.named_modules() if n.endswith(".experts")):
        count, hidden, inter = module.down_proj.shape
        weights = {
            "gate_up_proj": tuple(t.cpu() for t in _experts(count, 2 * inter, hidden, 32, gen)),
            "down_proj": tuple(t.cpu() for t in _experts(count, hidden, inter, 32, gen)),
        }
        int4_experts.keep(module, weights)
    assert experts_graph_reason(model, fast.layers) is None
