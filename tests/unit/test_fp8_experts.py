"""A mixture of experts' fp8 experts kept fp8 (engine/model/fp8_experts.py): the grouped product's Triton kernel
(under Triton's interpreter on a CPU, on the GPU in the GPU check), its tiles of rows, and fp8 Qwen3-MoE and Mixtral
checkpoints loaded with their experts kept fp8 and served with the tokens of their de-quantized model."""

from __future__ import annotations

import pytest
import torch

from helpers.kept_experts import DEVICE, kernel_runs, served_as
from helpers.llama_variants import MOE_ARCHS, build
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_experts, fp8_gemv, grouped_experts

needs_kernel = kernel_runs(fp8_gemv.available())


@pytest.fixture
def on_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped products on the Triton kernel here (a CPU's tensors under the interpreter)."""
    monkeypatch.setattr(fp8_experts, "INTERPRETED_ON_CPU", True)


def _experts(experts: int, outputs: int, inputs: int, block: int, gen: torch.Generator):
    weight = (torch.randn(experts, outputs, inputs, generator=gen) * 40).to(torch.float8_e4m3fn)
    shape = (experts, outputs, inputs // block) if block else (experts, outputs)
    return weight.to(DEVICE), (torch.rand(*shape, generator=gen) * 0.01 + 1e-3).to(DEVICE)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 3, 0, 4], [5, 17, 0, 1], [40, 0, 30, 2]])
@pytest.mark.parametrize("block", [0, 32], ids=["per-channel", "blocks-of-32"])
@pytest.mark.parametrize("native", [True, False], ids=["fp8-gpu", "no-fp8-gpu"])
@needs_kernel
def test_the_grouped_product_is_each_experts_dequantized_product(
    on_kernel: None, monkeypatch: pytest.MonkeyPatch, counts: list[int], block: int, native: bool
) -> None:
    """Rows sorted by expert (experts without rows between them), each row's product with its expert's fp8 weight
    times its scales, per channel or by blocks of inputs, on a GPU with fp8 conversions or widening the bytes (an
    A100's): what de-quantizing each expert's weight gives, in fp32 and in fp16 (and bf16 on a GPU: Triton's
    interpreter has no bf16 dot); an expert's rows past 16 (a tile) too."""
    if not native:
        monkeypatch.setattr(fp8_devices, "native", lambda device: False)
    gen = torch.Generator().manual_seed(len(counts) + sum(counts) + block)
    weight, scales = _experts(4, 96, 128, block, gen)
    rows = sum(counts)
    tallies = torch.tensor(counts, device=DEVICE)
    halves = (torch.float16,) + ((torch.bfloat16,) if DEVICE.type == "cuda" else ())  # (the interpreter's dot: no bf16)
    fp32 = 1e-5 if DEVICE.type == "cpu" else 5e-3  # (a GPU's fp32 dot: tf32)
    for dtype, tolerance in ((torch.float32, fp32), *((half, 2e-2) for half in halves)):
        x = torch.randn(rows, 128, generator=gen).to(DEVICE, dtype)
        got = fp8_experts.grouped_product(x, weight, scales, tallies)
        want = fp8_experts.dequantized_product(x.float(), weight, scales, tallies)
        assert got.dtype == dtype and got.shape == (rows, 96)
        assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), dtype


@pytest.mark.parametrize("block_m", [16, 64])
def test_the_row_tiles_cover_each_experts_rows_once_in_a_grid_the_routing_does_not_change(block_m: int) -> None:
    """Every row is in exactly one tile, each tile's rows are one expert's, at most `block_m` of them; the tiles past
    the rows are empty; and how many tiles there are depends on the rows alone (a CUDA graph replays one grid)."""
    gen = torch.Generator().manual_seed(block_m)
    sizes = set()
    for _ in range(20):
        experts = int(torch.randint(1, 9, (1,), generator=gen))
        ids = torch.sort(torch.randint(0, experts, (100,), generator=gen)).values
        counts = torch.bincount(ids, minlength=experts)
        expert, first, end = grouped_experts.row_tiles(counts, 100, block_m)
        sizes.add((experts, expert.shape[0]))
        covered = torch.zeros(100, dtype=torch.int64)
        for e, f, t in zip(expert.tolist(), first.tolist(), end.tolist(), strict=True):
            assert 0 <= t - f <= block_m
            covered[f:t] += 1
            assert (ids[f:t] == e).all()
        assert covered.eq(1).all()
    assert all(size == -(-100 // block_m) + min(experts, 100) for experts, size in sizes)


def test_a_cpu_keeps_the_experts_in_fp32_and_bf16_and_the_layout_servable_is_the_kernels() -> None:
    """On a CPU the experts stay fp8 (on its q8 kernel: `cpu_experts`) whether it computes in fp32 or in bf16."""
    model = build(*MOE_ARCHS["qwen3_moe"])
    assert fp8_experts.kept_for(model, torch.device("cpu"), "tiny")
    assert fp8_experts.kept_for(model.to(torch.bfloat16), torch.device("cpu"), "tiny")
    for arch in ("mixtral", "qwen2_moe_shared", "qwen3_moe", "glm4_moe", "olmoe"):
        first = next(m for n, m in build(*MOE_ARCHS[arch]).named_modules() if n.endswith(".experts"))
        assert grouped_experts.servable(first), arch
    gpt_oss = build(*MOE_ARCHS["gpt_oss"])  # ([experts, in, out], interleaved gate/up with biases: MXFP4's model)
    assert not grouped_experts.servable(gpt_oss.model.layers[0].mlp.experts)


CHECKPOINTS = {  # (architecture, quant_pack's format): Qwen3-30B-A3B-FP8's blocks, compressed-tensors' and ModelOpt's
    "qwen3-fp8-block": ("qwen3_moe", "fp8-block"),
    "qwen3-fp8-channel": ("qwen3_moe", "fp8-channel"),
    "qwen3-fp8-tensor": ("qwen3_moe", "fp8-tensor"),
    "mixtral-fp8-channel": ("mixtral", "fp8-channel"),
    "qwen2-moe-fp8-block": ("qwen2_moe_shared", "fp8-block"),
}


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter; the kernel test covers CUDA")
@pytest.mark.parametrize("case", list(CHECKPOINTS))
@needs_kernel
def test_an_fp8_mixture_of_experts_kept_fp8_serves_its_dequantized_models_tokens(
    tiny_model, tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, on_kernel: None, case: str
) -> None:
    """An fp8 MoE checkpoint loaded where its experts stay fp8 (as on a GPU where de-quantized they would not fit:
    `fp8_experts.kept_for` forced): every experts module holds the checkpoint's fp8 values and each row's scales,
    the start's account says so, and the engine on the fast path, its decode steps in the decode graphs (played on a
    CPU, watched for host syncs), gives the greedy tokens of the same checkpoint de-quantized at load (fp32)."""
    from safetensors.torch import load_file

    from helpers.kept_experts import load_both, serve_counted
    from helpers.quantizable import write_checkpoint

    arch, fmt = CHECKPOINTS[case]
    write_checkpoint(build(*MOE_ARCHS[arch]), tmp_path, fmt, 16)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    dequantized, loaded, record, lines = load_both(tmp_path, monkeypatch, caplog, fp8_experts)
    kept = [m for m in loaded.model.modules() if grouped_experts.kept(m)]
    assert kept and len(kept) == sum(1 for n, _ in loaded.model.named_modules() if n.endswith(".experts"))
    assert any("experts modules kept fp8" in line for line in lines)
    stored = load_file(tmp_path / "model.safetensors")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    first = "w1" if arch == "mixtral" else "gate_proj"
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scales.dtype == torch.float32
    stored_first = stored[f"model.layers.0.{block}.experts.1.{first}.weight"]
    assert torch.equal(
        experts.gate_up_proj[1, : stored_first.shape[0]].view(torch.uint8), stored_first.view(torch.uint8)
    )
    assert experts.down_proj_scales.dim() == (3 if fmt == "fp8-block" else 2)

    engine, ran = serve_counted(loaded, dequantized, monkeypatch, fp8_experts)
    assert engine.runner.path == "fast" and record.steps and ran


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter; the kernel test covers CUDA")
@needs_kernel
def test_quantize_fp8_on_a_float_mixture_of_experts_keeps_its_experts_fp8_per_channel(
    tiny_model, tmp_path, monkeypatch: pytest.MonkeyPatch, on_kernel: None
) -> None:
    """``quantize=fp8`` on a float Qwen3-MoE where the experts stay fp8 (`kept_for` forced, as where de-quantized
    they would not fit): each expert's matrices are quantized with a scale a row (`quantize_fp8`'s), and the engine
    on the fast path gives the greedy tokens of the float model whose experts are those fp8 values times their
    scales. Where they are not kept, they stay float (a CPU's rule in bf16, here its fp32 kernel's left unasked)."""
    from lmiserve.engine.model import cpu_experts
    from lmiserve.engine.model.fp8_ops import quantize_fp8
    from lmiserve.models.load import load_causal_lm

    original = build(*MOE_ARCHS["qwen3_moe"])
    original.save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)
    float_experts = load_causal_lm(tmp_path, dtype="fp32", device="cpu", quantize="fp8")
    assert not any(grouped_experts.kept(m) for m in float_experts.model.modules())
    monkeypatch.setattr(fp8_experts, "kept_for", lambda model, device, name: True)
    loaded = load_causal_lm(tmp_path, dtype="fp32", device="cpu", quantize="fp8")
    for layer, reference in zip(loaded.model.model.layers, float_experts.model.model.layers, strict=True):
        experts = layer.mlp.experts
        assert grouped_experts.kept(experts)
        for kind in ("gate_up_proj", "down_proj"):
            weight, scales = getattr(experts, kind), getattr(experts, f"{kind}_scales")
            q, s = quantize_fp8(getattr(original.model.layers[layer.self_attn.layer_idx].mlp.experts, kind)[2])
            assert torch.equal(weight[2].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scales[2], s)
            dequantized = weight.float() * scales[..., None]
            setattr(reference.mlp.experts, kind, torch.nn.Parameter(dequantized, requires_grad=False))
    assert served_as(loaded, float_experts).runner.path == "fast"


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter; the kernel test covers CUDA")
@pytest.mark.parametrize(
    ("fmt", "inter", "world", "pads"),
    [
        ("fp8-channel", 64, 2, [(0, 0), (0, 0)]),
        ("fp8-block", 64, 2, [(0, 0), (0, 0)]),  # 32 inputs a rank: whole blocks of 16
        ("fp8-block", 48, 2, [(0, 8), (8, 0)]),  # 24 a rank: 0-24 kept as 0-32, 24-48 as 16-48
        ("fp8-block", 48, 4, [(0, 4), (12, 8), (8, 12), (4, 0)]),  # 12 a rank (Qwen3-235B-A22B-FP8 over 8: 192)
    ],
)
@needs_kernel
def test_each_tensor_parallel_rank_keeps_its_part_of_the_fp8_experts(
    tmp_path, monkeypatch: pytest.MonkeyPatch, on_kernel: None, fmt: str, inter: int, world: int, pads: list
) -> None:
    """Over two and four ranks each rank reads its part of every expert's fp8 matrices (gate/up's rows, down's
    inputs) with their scales (a channel's, or blocks of 16), kept fp8: the ranks' MoE blocks (what the all-reduce
    adds) are the block of the checkpoint de-quantized whole in one process. Where a rank's inputs of down_proj are
    not whole blocks it keeps the whole blocks that cover them and pads its activations with zeros (`pads`)."""
    from helpers.kept_experts import assert_ranks_sum, assert_widened, rank_blocks
    from helpers.quantizable import write_checkpoint

    config_class, model_class, overrides = MOE_ARCHS["qwen3_moe"]
    model = build(config_class, model_class, {**overrides, "moe_intermediate_size": inter})
    write_checkpoint(model, tmp_path, fmt, 16)
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, fp8_experts, world):
        assert_widened(parts, "fp8", pads, inter // world)
        assert all(part.experts.gate_up_proj.shape[1] == 2 * inter // world for part in parts)
        assert_ranks_sum(block, parts, model.config.hidden_size)


@pytest.mark.parametrize("kept", [[True, True], [True, False]], ids=["both-ranks-keep", "one-rank-would-not"])
def test_quantize_fp8_over_two_ranks_keeps_each_ranks_part_of_one_processs_fp8_experts(
    tmp_path, kept, on_kernel: None
) -> None:
    """``quantize=fp8`` on a float Qwen3-MoE over two ranks (real processes in a gloo group): each rank's experts are
    its part (gate/up's rows, down's inputs) of the fp8 experts one process makes, down_proj's scales its whole
    rows' (the ranks' maxima all-reduced, where a rank's own would differ). Where one rank's `kept_for` says no
    (less room on its GPU) neither keeps them: both stay float, the float model's parts."""
    from helpers.gloo_ranks import fp8_experts_at_load, run_ranks
    from helpers.rank_shards import cut

    ranks = run_ranks(2, fp8_experts_at_load, tmp_path, "qwen3_moe", kept)
    whole = build(*MOE_ARCHS["qwen3_moe"])
    if all(kept):
        for layer in whole.model.layers:
            experts = layer.mlp.experts
            fp8_experts.quantize(experts)
            for kind in ("gate_up_proj", "down_proj"):
                dequantized = getattr(experts, kind).float() * getattr(experts, f"{kind}_scales")[..., None]
                delattr(experts, f"{kind}_scales")
                setattr(experts, kind, torch.nn.Parameter(dequantized, requires_grad=False))
    for made, part in zip(ranks, cut(whole, 2), strict=True):
        for layer, want in zip(made, part.model.layers, strict=True):
            assert bool(layer["kept"]) == all(kept) and int(layer["count"]) == len(made) * all(kept)
            for kind in ("gate_up_proj", "down_proj"):
                assert torch.equal(layer[kind], getattr(want.mlp.experts, kind).detach()), kind


def test_the_decode_graphs_capture_fp8_experts_in_any_dtype(on_kernel: None) -> None:
    """torch's grouped product waits for the device outside bf16 (`experts_graph_reason`); the fp8 experts' kernel
    finds its tiles on the device, so a model whose experts are all kept fp8 is captured in fp32 too."""
    from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
    from lmiserve.engine.model.fast_llama import FastLlama
    from lmiserve.engine.model.layout_variants import experts_graph_reason

    model = build(*MOE_ARCHS["qwen3_moe"])
    cfg = model.config
    cache = PagedKVCache(
        cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, AttentionShape.of(cfg).head_dim, torch.float32, "cpu"
    )
    fast = FastLlama(model, cache, 64)
    assert "float32" in (experts_graph_reason(model, fast.layers) or "")
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    fp8_experts.quantize(experts[0])
    assert "float32" in (experts_graph_reason(model, fast.layers) or "")  # (one layer's still float)
    for module in experts[1:]:
        fp8_experts.quantize(module)
    assert experts_graph_reason(model, fast.layers) is None
