"""A mixture of experts' quantized experts kept quantized on a CPU (engine/model/cpu_experts.py): the grouped product
over each expert's packed q8 (fp8 or int8 codes), f4 (gpt-oss's MXFP4) or q4 (AWQ/GPTQ) matrix against
its de-quantized weight, the shapes the kernels refuse, and fp8, 8-bit and 4-bit Qwen3-MoE and Mixtral checkpoints
(and ``quantize=fp8`` on a float one) and gpt-oss's MXFP4 loaded as a CPU loads them, served with the tokens of the
same checkpoint de-quantized, on one process and over tensor-parallel ranks."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from helpers.kept_experts import moe, served_as
from lmiserve.engine.model import cpu_experts, fp8_experts, grouped_experts, int4_experts, mxfp4_experts
from lmiserve.engine.model.group_kernels import unpack_f4, unpack_q4, unpack_q8
from lmiserve.engine.model.quantize import int4_available

pytestmark = pytest.mark.skipif(not int4_available(), reason="the CPU's group kernels need numba")

COUNTS = [[1, 0, 0, 0], [0, 3, 0, 4], [5, 17, 0, 1], [40, 0, 30, 2]]


def _experts_module() -> torch.nn.Module:
    return next(m for n, m in moe("qwen3_moe").named_modules() if n.endswith(".experts"))


def _q8(dtype: torch.dtype, out: int, inputs: int, block: int, gen: torch.Generator):
    if dtype == torch.int8:
        codes = torch.randint(-128, 128, (4, out, inputs), generator=gen, dtype=torch.int8)
    else:
        codes = (torch.randn(4, out, inputs, generator=gen) * 40).to(torch.float8_e4m3fn)
    shape = (4, out, inputs // block) if block else (4, out)
    return codes, torch.rand(*shape, generator=gen) * 0.01 + 1e-3


def _q4(out: int, inputs: int, group: int, act_order: bool, gen: torch.Generator):
    words = torch.randint(-(2**31), 2**31 - 1, (4, out, inputs // 8), generator=gen, dtype=torch.int32)
    scales = torch.rand(4, inputs // group, out, generator=gen) * 0.01 + 1e-3
    zeros = torch.randint(0, 16, (4, inputs // group, out), generator=gen).float()
    order = torch.stack([torch.randperm(inputs, generator=gen) for _ in range(4)]).int() if act_order else None
    return words, scales, zeros, order


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(
    ("dtype", "block"),
    [
        (torch.float8_e4m3fn, 0),
        (torch.float8_e4m3fn, 16),
        (torch.float8_e4m3fn, 128),
        (torch.int8, 0),
        (torch.int8, 32),
    ],
    ids=["fp8-channel", "fp8-blocks-of-16", "fp8-blocks-of-128", "int8-channel", "int8-groups-of-32"],
)
def test_the_q8_grouped_product_is_each_experts_dequantized_product(
    counts: list[int], dtype: torch.dtype, block: int
) -> None:
    """Rows sorted by expert (experts without rows between them), each row's product with its expert's fp8 or int8
    codes times their channel's or block's scale: what de-quantizing each expert's weight gives (fp32); each
    expert's packed matrix holds the codes and scales exactly."""
    gen = torch.Generator().manual_seed(sum(counts) + block)
    experts = _experts_module()
    codes, scales = _q8(dtype, 96, 256, block, gen)
    assert cpu_experts.keep_q8(experts, {"down_proj": (codes, scales)}, (0, 0))
    assert grouped_experts.kept(experts, "q8")
    got_codes, got_scales = unpack_q8(experts.down_proj[3], experts.down_proj_scales[3], 96)
    assert torch.equal(got_codes.view(torch.uint8), codes[3].view(torch.uint8))
    assert torch.equal(got_scales[:, :: got_scales.shape[1] // max(1, scales[3].reshape(96, -1).shape[1])].flatten(),
                       scales[3].reshape(96, -1).flatten())  # fmt: skip
    x = torch.randn(sum(counts), 256, generator=gen)
    tallies = torch.tensor(counts)
    got = experts.__dict__["kept_product"](x, experts, "down_proj", tallies)
    want = fp8_experts.dequantized_product(x, codes, scales, tallies)
    assert got.dtype == torch.float32 and got.shape == (sum(counts), 96)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize(("group", "act_order"), [(32, False), (128, False), (32, True)], ids=["g32", "g128", "act"])
def test_the_q4_grouped_product_is_each_experts_dequantized_product(
    counts: list[int], group: int, act_order: bool
) -> None:
    """The same over AWQ/GPTQ 4-bit codes (``w = (code - zero) * scale`` by groups of inputs), GPTQ's act-order
    experts' rows gathered in each expert's own stored order of inputs."""
    gen = torch.Generator().manual_seed(sum(counts) + group)
    experts = _experts_module()
    words, scales, zeros, order = _q4(64, 256, group, act_order, gen)
    parts = (words, scales, zeros) if order is None else (words, scales, zeros, order)
    assert cpu_experts.keep_q4(experts, {"gate_up_proj": parts}, (0, 0))
    assert grouped_experts.kept(experts, "q4") and (getattr(experts, "gate_up_proj_order", None) is None) != act_order
    codes, scale, low = unpack_q4(experts.gate_up_proj[1], experts.gate_up_proj_scales[1], 64)
    weight = int4_experts.dequantized_weight(words[1], scales[1], zeros[1])  # (as stored: in the stored order)
    dequantized = (codes.float().view(64, -1, 32) * scale[..., None] + low[..., None]).view(64, 256)
    torch.testing.assert_close(dequantized, weight, rtol=0, atol=1e-6)
    x = torch.randn(sum(counts), 256, generator=gen)
    tallies = torch.tensor(counts)
    got = experts.__dict__["kept_product"](x, experts, "gate_up_proj", tallies)
    want = int4_experts.dequantized_product(x, words, scales, zeros, tallies, order)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("counts", COUNTS)
def test_mxfp4_experts_are_kept_as_their_4_bit_floats(counts: list[int]) -> None:
    """gpt-oss's MXFP4 experts (`mxfp4_experts.keep` on a CPU) on the f4 kernel: each packed matrix holds the
    checkpoint's e2m1 codes, half a byte a weight, and its blocks' powers of two (2 ** -10 to 2 ** 10) as fp32 scales,
    so it de-quantizes to exactly the MXFP4 weight, and the grouped product is each expert's de-quantized product."""
    gen = torch.Generator().manual_seed(sum(counts))
    experts = _experts_module()
    blocks = torch.randint(0, 256, (4, 96, 128), generator=gen).to(torch.uint8)  # (256 inputs: 8 blocks of 32)
    powers = torch.randint(117, 138, (4, 96, 8), generator=gen).to(torch.uint8)
    mxfp4_experts.keep(experts, {"down_proj": (blocks, powers)})
    assert grouped_experts.kept(experts, "f4") and experts.down_proj.shape == (4, 96 // 16, 128 * 16)
    values = torch.tensor(mxfp4_experts.FP4)
    for e in range(4):
        codes, scale = unpack_f4(experts.down_proj[e], experts.down_proj_scales[e], 96)
        weight = (values[codes.long()].view(96, 8, 32) * scale[..., None]).view(96, 256)
        assert torch.equal(weight, mxfp4_experts.dequantized_weight(blocks[e], powers[e])), e
    x = torch.randn(sum(counts), 256, generator=gen)
    tallies = torch.tensor(counts)
    got = experts.__dict__["kept_product"](x, experts, "down_proj", tallies)
    want = mxfp4_experts.dequantized_product(x, blocks, powers, tallies)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_shapes_the_kernels_do_not_take_are_left_as_they_were() -> None:
    """Outputs not a multiple of 16, runs of 8 inputs a scale (q8), groups of 16 inputs (q4): nothing is kept, the
    module keeps its float experts (the loader then de-quantizes them)."""
    gen = torch.Generator().manual_seed(0)
    experts = _experts_module()
    before = experts.down_proj
    assert not cpu_experts.keep_q8(experts, {"down_proj": _q8(torch.float8_e4m3fn, 40, 64, 0, gen)}, (0, 0))
    assert not cpu_experts.keep_q8(experts, {"down_proj": _q8(torch.int8, 96, 64, 8, gen)}, (0, 0))
    assert not cpu_experts.keep_q4(experts, {"down_proj": _q4(96, 64, 16, False, gen)[:3]}, (0, 0))
    assert not grouped_experts.kept(experts) and experts.down_proj is before


def test_a_ranks_part_of_down_proj_under_a_scale_a_row_is_widened_to_whole_groups() -> None:
    """24 of down_proj's inputs (a rank's half of 48, ``quantize=fp8``'s scale a row): stored with 8 zero inputs
    after them, the activations padded to match (`kept_down_pad`), the product that of the 24."""
    gen = torch.Generator().manual_seed(1)
    experts = _experts_module()
    codes, scales = _q8(torch.float8_e4m3fn, 64, 24, 0, gen)
    assert cpu_experts.keep_q8(experts, {"down_proj": (codes, scales)}, (0, 0))
    assert experts.__dict__["kept_down_pad"] == (0, 8) and experts.down_proj.shape[2] == 32 * 16
    x, tallies = torch.randn(6, 24, generator=gen), torch.tensor([2, 0, 3, 1])
    got = experts.__dict__["kept_product"](torch.nn.functional.pad(x, (0, 8)), experts, "down_proj", tallies)
    want = fp8_experts.dequantized_product(x, codes, scales, tallies)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_cpu_keeps_experts_in_fp32_and_bf16_where_its_kernels_run(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 and bf16 on a CPU: kept, and logged; without numba: de-quantized, and logged why; a GPU: not this
    module's."""
    fp32 = moe("qwen3_moe")
    with caplog.at_level("INFO", logger="lmiserve.engine.model.cpu_experts"):
        assert cpu_experts.kept_for(fp32, torch.device("cpu"), "tiny", "fp8")
        assert cpu_experts.kept_for(fp32.to(torch.bfloat16), torch.device("cpu"), "tiny", "4-bit")
        monkeypatch.setattr(cpu_experts, "available", lambda: False)
        assert not cpu_experts.kept_for(fp32, torch.device("cpu"), "tiny", "MXFP4")
    assert not cpu_experts.kept_for(fp32, torch.device("cuda"), "tiny", "fp8")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tiny: fp8 experts on the CPU's group kernels",
        "tiny: 4-bit experts on the CPU's group kernels",
        "tiny: MXFP4 experts de-quantized at load (no numba: the CPU's group kernels do not run)",
    ]


# (architecture, quant_pack's format, group or block, act-order, the kernel): Qwen3-30B-A3B-FP8's blocks,
# compressed-tensors' fp8 by channel and by tensor, a Mixtral (w1-w3), GPTQ-Int8, llm-compressor's W8A8, AutoAWQ's,
# GPTQ with act-order, compressed-tensors' asymmetric W4A16 (one group a row)
CHECKPOINTS = {
    "qwen3-fp8-block": ("qwen3_moe", "fp8-block", 16, False, "q8"),
    "qwen3-fp8-channel": ("qwen3_moe", "fp8-channel", 16, False, "q8"),
    "qwen3-fp8-tensor": ("qwen3_moe", "fp8-tensor", 16, False, "q8"),
    "mixtral-fp8-channel": ("mixtral", "fp8-channel", 16, False, "q8"),
    "qwen3-gptq-int8-g32": ("qwen3_moe", "gptq-int8", 32, False, "q8"),
    "qwen3-w8a8-channel": ("qwen3_moe", "w8a8", 0, False, "q8"),
    "qwen3-awq-g32": ("qwen3_moe", "awq", 32, False, "q4"),
    "mixtral-awq-g32": ("mixtral", "awq", 32, False, "q4"),
    "qwen3-gptq-act-order": ("qwen3_moe", "gptq", 32, True, "q4"),
    "qwen3-w4a16-asym-channel": ("qwen3_moe", "w4a16-asym", 0, False, "q4"),
}


def _loaded_twice(path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, dtype: str = "fp32"):
    """The checkpoint in `path` loaded on the CPU in fp32 with its experts de-quantized (`cpu_experts.kept_for`
    answering no), then as the server loads it in `dtype`: (the de-quantized model, the loaded one, the second
    load's log lines)."""
    from lmiserve.models.load import load_causal_lm

    with monkeypatch.context() as dequantizing:
        dequantizing.setattr(cpu_experts, "kept_for", lambda *args: False)
        dequantized = load_causal_lm(path, dtype="fp32", device="cpu")
    caplog.clear()
    with caplog.at_level("INFO", logger="lmiserve.models.load"):
        loaded = load_causal_lm(path, dtype=dtype, device="cpu")
    return dequantized, loaded, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_a_quantized_mixture_of_experts_on_a_cpu_serves_its_dequantized_models_tokens(
    tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A quantized MoE checkpoint loaded on a CPU in fp32, as the server loads it: every experts module is kept on
    the CPU's q8 or q4 kernel, its matrices the checkpoint's values (as its de-quantized load gives them), the
    start's account says so, and the engine (prompts joining a running batch) gives the greedy tokens of the same
    checkpoint de-quantized at load, through the kept experts' grouped product."""
    from helpers.kept_experts import serve_counted
    from helpers.quantizable import write_checkpoint

    arch, fmt, group, act_order, kernel = CHECKPOINTS[case]
    write_checkpoint(moe(arch), tmp_path, fmt, group, act_order=act_order)
    dequantized, loaded, said = _loaded_twice(tmp_path, monkeypatch, caplog)
    assert not any(grouped_experts.kept(m) for m in dequantized.model.modules())
    names = [n for n, _ in loaded.model.named_modules() if n.endswith(".experts")]
    assert names and all(grouped_experts.kept(loaded.model.get_submodule(n), kernel) for n in names)
    account = f"experts modules kept {'fp8' if fmt.startswith('fp8') else ''}"
    assert any(account in line and f"(the CPU's {kernel} kernel)" in line for line in said), said
    experts, reference = loaded.model.model.layers[1].mlp.experts, dequantized.model.model.layers[1].mlp.experts
    for kind in ("gate_up_proj", "down_proj"):
        want = getattr(reference, kind)[2]
        codes, scales = getattr(experts, kind)[2], getattr(experts, f"{kind}_scales")[2]
        if kernel == "q8":
            got, scale = unpack_q8(codes, scales, want.shape[0])
            weight = (got.float().view(want.shape[0], scale.shape[1], -1) * scale[..., None]).view_as(want)
            assert torch.equal(weight, want), kind
        else:
            got, scale, low = unpack_q4(codes, scales, want.shape[0])
            weight = (got.float().view(want.shape[0], -1, 32) * scale[..., None] + low[..., None]).view_as(want)
            order = getattr(experts, f"{kind}_order", None)
            if order is not None:
                weight = torch.empty_like(weight).index_copy_(1, order[2], weight)
            torch.testing.assert_close(weight, want, rtol=0, atol=1e-6)

    engine, ran = serve_counted(loaded, dequantized, monkeypatch, cpu_experts)
    assert engine.runner.path == "fast" and ran


def test_quantize_fp8_on_a_float_mixture_of_experts_keeps_its_experts_fp8_on_a_cpu(
    tmp_path, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quantize=fp8`` on a float Qwen3-MoE on a CPU: the experts are quantized with a scale a row
    (`quantize_fp8`'s) and kept on the q8 kernel, the account says so, and the engine gives the greedy tokens of the
    same load whose experts are left float, set to those fp8 values times their scales."""

    from helpers.quantizable import write_checkpoint
    from lmiserve.engine.model.fp8_ops import quantize_fp8
    from lmiserve.models.load import load_causal_lm

    write_checkpoint(moe("qwen3_moe"), tmp_path, "float")
    with caplog.at_level("INFO", logger="lmiserve.models.load"):
        loaded = load_causal_lm(tmp_path, dtype="fp32", device="cpu", quantize="fp8")
    account = "experts modules kept fp8 per output channel (the CPU's q8 kernel)"
    assert any(account in r.getMessage() for r in caplog.records)
    with monkeypatch.context() as floats:  # (the linears fp8 too, the experts left float)
        floats.setattr(cpu_experts, "kept_for", lambda *args: False)
        reference = load_causal_lm(tmp_path, dtype="fp32", device="cpu", quantize="fp8")
    for layer, ref_layer in zip(loaded.model.model.layers, reference.model.model.layers, strict=True):
        assert grouped_experts.kept(layer.mlp.experts, "q8")
        for kind in ("gate_up_proj", "down_proj"):
            made = [quantize_fp8(m) for m in getattr(ref_layer.mlp.experts, kind).detach()]
            dequantized = torch.stack([q.float() * s[:, None] for q, s in made])
            setattr(ref_layer.mlp.experts, kind, torch.nn.Parameter(dequantized, requires_grad=False))
    assert served_as(loaded, reference).runner.path == "fast"


@pytest.mark.parametrize(
    ("fmt", "kernel", "pads"),
    [
        ("fp8-block", "q8", [(0, 0), (0, 0)]),  # 48 inputs of down a rank: whole blocks of 16
        ("awq", "q4", [(0, 16), (16, 0)]),  # 48 a rank in groups of 32: 0-48 kept as 0-64, 48-96 as 32-96
    ],
)
def test_each_tensor_parallel_rank_keeps_its_part_of_the_experts_on_the_cpu(
    tmp_path, monkeypatch: pytest.MonkeyPatch, fmt: str, kernel: str, pads: list
) -> None:
    """Over two ranks each rank reads its part of every expert's matrices kept on the CPU's kernel, down_proj's
    inputs widened to whole groups where they are not (`pads`): the ranks' MoE blocks (what the all-reduce adds) are
    the block of the checkpoint de-quantized whole in one process."""
    from helpers.kept_experts import assert_ranks_sum, rank_blocks
    from helpers.quantizable import write_checkpoint

    model = moe("qwen3_moe", {"moe_intermediate_size": 96})
    write_checkpoint(model, tmp_path, fmt, 16 if fmt.startswith("fp8") else 32)
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, cpu_experts):
        for part, pad in zip(parts, pads, strict=True):
            assert grouped_experts.kept(part.experts, kernel) and part.experts.__dict__["kept_down_pad"] == pad
        assert_ranks_sum(block, parts, model.config.hidden_size)


def test_an_mxfp4_gpt_oss_on_a_cpu_serves_its_dequantized_models_tokens(
    tmp_path, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's MXFP4 checkpoint as OpenAI publishes it, loaded on a CPU in fp32 as the server loads it: every
    experts module kept on the f4 kernel (half a byte a weight, not fp32's four) with its biases, each matrix exactly
    what transformers de-quantizes, the start's account says so, and the engine gives the greedy tokens of the
    checkpoint de-quantized at load through the kept experts' grouped product."""
    from helpers.kept_experts import serve_counted
    from helpers.mxfp4 import write_mxfp4_gpt_oss

    state = write_mxfp4_gpt_oss(tmp_path)
    dequantized, loaded, said = _loaded_twice(tmp_path, monkeypatch, caplog)
    account = "mxfp4 checkpoint: 2 experts modules kept MXFP4 (the CPU's f4 kernel)"
    assert any(account in line for line in said)
    values = torch.tensor(mxfp4_experts.FP4)
    for i, layer in enumerate(loaded.model.model.layers):
        experts = layer.mlp.experts
        assert grouped_experts.kept(experts, "f4")
        for kind in ("gate_up_proj", "down_proj"):
            want = state[f"model.layers.{i}.mlp.experts.{kind}"]  # ([experts, in, out], as transformers holds them)
            codes, scales = getattr(experts, kind), getattr(experts, f"{kind}_scales")
            for e in range(want.shape[0]):
                got, scale = unpack_f4(codes[e], scales[e], want.shape[2])
                weight = (values[got.long()].view(want.shape[2], scale.shape[1], -1) * scale[..., None]).flatten(1)
                assert torch.equal(weight.t(), want[e]), (kind, e)
            assert torch.equal(getattr(experts, f"{kind}_bias"), state[f"model.layers.{i}.mlp.experts.{kind}_bias"])
    engine, ran = serve_counted(loaded, dequantized, monkeypatch, cpu_experts)
    assert engine.runner.path == "fast" and ran


BF16_CASES = {"qwen3-fp8-block": "q8", "qwen3-awq-g32": "q4", "gpt-oss-mxfp4": "f4"}


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_with_dtype_bf16_a_cpu_keeps_the_experts_and_rounds_their_fp32_output_once(
    tmp_path, caplog, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """``dtype=bf16`` on a CPU (the rest of the model in bf16): the experts stay on the CPU's kernel (the account says
    so) and each experts module's output is the checkpoint's de-quantized experts' in fp32 (the rows widened, the
    biases as bf16 holds them) rounded to bf16 once; the engine serves the kept model's own greedy tokens, through
    the kernels."""
    from helpers.llama_variants import PROMPTS, serve_prompts
    from helpers.mxfp4 import write_mxfp4_gpt_oss
    from helpers.quantizable import write_checkpoint
    from lmiserve.engine.core.async_engine import EngineConfig

    kernel = BF16_CASES[case]
    if kernel == "f4":
        write_mxfp4_gpt_oss(tmp_path)
    else:
        arch, fmt, group, act_order, _ = CHECKPOINTS[case]
        write_checkpoint(moe(arch), tmp_path, fmt, group, act_order=act_order)
    reference, loaded, said = _loaded_twice(tmp_path, monkeypatch, caplog, "bf16")
    assert any("experts modules kept" in line and f"(the CPU's {kernel} kernel)" in line for line in said), said
    assert loaded.model.get_input_embeddings().weight.dtype == torch.bfloat16
    config, gen = loaded.model.config, torch.Generator().manual_seed(3)
    rows, top_k = 9, config.num_experts_per_tok
    for layer, ref_layer in zip(loaded.model.model.layers, reference.model.model.layers, strict=True):
        experts, ref_experts = layer.mlp.experts, ref_layer.mlp.experts
        assert grouped_experts.kept(experts, kernel)
        for name, bias in ref_experts.named_parameters():  # (the biases as the bf16 model holds them)
            if name.endswith("_bias"):
                bias.data = bias.data.bfloat16().float()
        x = torch.randn(rows, config.hidden_size, generator=gen).bfloat16()
        chosen = torch.stack([torch.randperm(experts.gate_up_proj.shape[0], generator=gen)[:top_k] for _ in x])
        weights = torch.rand(rows, top_k, generator=gen).softmax(-1).bfloat16()
        with torch.inference_mode():
            got = experts(x, chosen, weights)
            want = ref_experts(x.float(), chosen, weights.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2**-7, atol=1e-3 * want.abs().max())
    # served: prompts joining a running batch, 8 tokens each, every step's experts through the kernels (bf16's
    # chunked prompts round differently from generate()'s whole ones, so the tokens are not compared to it here)
    ran: list[int] = []
    product = cpu_experts.grouped_product
    monkeypatch.setattr(cpu_experts, "grouped_product", lambda x, *rest: ran.append(x.shape[0]) or product(x, *rest))
    served = dataclasses.replace(loaded, max_context=256)
    engine, results = asyncio.run(serve_prompts(served, EngineConfig(max_prefill_tokens=4), 8))
    assert engine.runner.path == "fast" and [sum(1 for e in ev if e.token) for ev in results] == [8] * len(PROMPTS)
    assert min(ran) <= top_k * len(PROMPTS) and max(ran) > top_k  # (decode steps' rows and prompt chunks')


@pytest.mark.parametrize(
    ("intermediate", "world", "pads"),
    [
        (96, 2, [(0, 16), (16, 0)]),  # 48 inputs of down a rank: 0-48 kept as 0-64, 48-96 as 32-96
        (96, 4, [(0, 8), (24, 16), (16, 24), (8, 0)]),  # 24 a rank (gpt-oss-120b's 2880 over 4 and 8 ranks)
    ],
)
def test_each_tensor_parallel_rank_keeps_its_part_of_the_mxfp4_experts_on_the_cpu(
    tmp_path, monkeypatch: pytest.MonkeyPatch, intermediate: int, world: int, pads: list
) -> None:
    """Over two and four ranks each rank keeps its part of gpt-oss's MXFP4 experts on the f4 kernel, down_proj's
    inputs widened to whole blocks of 32 (`pads`): the ranks' MoE blocks add up to the block de-quantized whole."""
    from helpers.kept_experts import assert_ranks_sum, rank_blocks
    from helpers.llama_variants import MOE_ARCHS, build
    from helpers.mxfp4 import write_mxfp4_gpt_oss

    write_mxfp4_gpt_oss(tmp_path, intermediate)
    config_class, model_class, overrides = MOE_ARCHS["gpt_oss"]
    model = build(config_class, model_class, {**overrides, "intermediate_size": intermediate})
    for block, parts in rank_blocks(model, tmp_path, monkeypatch, cpu_experts, world):
        for part, pad in zip(parts, pads, strict=True):  # (f4's layout: 16 outputs' codes two inputs a byte)
            assert grouped_experts.kept(part.experts, "f4") and part.experts.__dict__["kept_down_pad"] == pad
            assert part.experts.down_proj.shape[2] == (intermediate // world + sum(pad)) * 8
        assert_ranks_sum(block, parts, model.config.hidden_size)


def test_the_decode_graphs_leave_experts_kept_on_the_cpu_to_the_eager_steps() -> None:
    """The CPU's grouped product loops over the experts hit on the host: no graph captures it."""
    from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
    from lmiserve.engine.model.fast_llama import FastLlama
    from lmiserve.engine.model.layout_variants import experts_graph_reason

    model = moe("qwen3_moe")
    cfg = model.config
    cache = PagedKVCache(
        cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, AttentionShape.of(cfg).head_dim, torch.float32, "cpu"
    )
    fast = FastLlama(model, cache, 64)
    gen = torch.Generator().manual_seed(0)
    for module in (m for n, m in model.named_modules() if n.endswith(".experts")):
        count, hidden, inter = module.down_proj.shape
        codes, scales = _q8(torch.float8_e4m3fn, 2 * inter, hidden, 0, gen)
        weights = {"gate_up_proj": (codes[:1].expand(count, -1, -1), scales[:1].expand(count, -1))}
        assert cpu_experts.keep_q8(module, weights, (0, 0))
    assert "host" in (experts_graph_reason(model, fast.layers) or "")
