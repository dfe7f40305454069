"""Mixtures of experts on lmiserve's own forward (engine/model/layout_variants.py `moe_block`): Mixtral's,
Qwen2-MoE's (a gated shared expert beside, some layers dense) and Qwen3-MoE's layers run their attention on the
fast forward and their experts through the model's own block, with the decode graphs (captured on CUDA in
bfloat16; on a CPU their buffers run, watched for what a capture cannot hold: tests/conftest.py). LoRA adapters
on a mixture of experts are served by transformers' forward."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from helpers.decode_graphs import graphs_on_the_test_device
from helpers.llama_variants import MOE_ARCHS, PROMPTS, build, greedy_tokens, serve_prompts
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.engine.model.layout_variants import experts_graph_reason

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
CAPTURE = DEVICE.type == "cuda"
# on CUDA the graphs capture the experts' grouped products in bfloat16 alone (`experts_graph_reason`)
# fp32 against transformers' fp32 (on CUDA: cuBLAS's fp32 products in another order, the kernel's fp32 dot)
CLOSE = {"rtol": 1e-3, "atol": 1e-3} if CAPTURE else {"rtol": 1e-4, "atol": 1e-4}
CAPTURED_CLOSE = {"rtol": 0.0, "atol": 1e-2}  # a replay against the same kernels played: a few ulps at most
SCRATCH = 64


def _cache_shape(model: torch.nn.Module) -> tuple[int, int, int, int, int]:
    cfg = model.config
    return cfg.num_hidden_layers, SCRATCH + 1, 4, cfg.num_key_value_heads, AttentionShape.of(cfg).head_dim


def _fast(arch: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, FastLlama]:
    model = build(*MOE_ARCHS[arch]).to(DEVICE, dtype)
    return model, FastLlama(model, PagedKVCache(*_cache_shape(model), dtype, DEVICE), 256)


def test_each_layer_runs_the_models_own_experts_and_nothing_else_of_its_mlp():
    """An MoE layer keeps the model's block (router, experts, shared expert) and fuses no MLP weight; a dense
    layer of an MoE model (Qwen2-MoE's `mlp_only_layers`) fuses its gate/up as any other; adapters' groups
    cover attention everywhere and the dense MLPs alone."""
    model, fast = _fast("qwen2_moe_shared")
    moe, dense = fast.layers
    assert moe.moe is model.model.layers[0].mlp and dense.moe is None
    assert moe.gate_up == () and moe.down_w.numel() == 0 and len(moe.parts()) == 2  # q/k/v and o
    assert dense.gate_up and dense.down_w.shape == (64, 128) and len(dense.parts()) == 4
    names = [group.key for group in fast.lora_groups()]
    assert names == ["0.qkv", "0.o", "1.qkv", "1.o", "1.gate_up", "1.down"]
    assert not fast.plain_layers  # (no packed int4 layers: they have no experts)


def test_which_mixtures_of_experts_the_fast_forward_covers():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from lmiserve.engine.model.fast_llama import unsupported_reason

    for arch in MOE_ARCHS:
        assert unsupported_reason(build(*MOE_ARCHS[arch])) is None, arch
    clipped = build(OlmoeConfig, OlmoeForCausalLM, {**MOE_ARCHS["olmoe"][2], "clip_qkv": 8.0})  # (OLMo's option)
    assert "clip_qkv" in (unsupported_reason(clipped) or "")
    unloaded = build(*MOE_ARCHS["mixtral"])
    unloaded.model.layers[1].mlp.experts.down_proj = torch.nn.Parameter(torch.empty(4, 64, 128, device="meta"))
    assert "experts are not loaded" in (unsupported_reason(unloaded) or "")


def test_the_graphs_capture_experts_in_bfloat16_through_grouped_products_alone():
    model = build(*MOE_ARCHS["mixtral"])
    _, fast = _fast("mixtral")
    assert "float32" in (experts_graph_reason(model, fast.layers) or "")
    assert fast.graph_refusal is not None
    assert experts_graph_reason(model.to(torch.bfloat16), fast.layers) is None
    model.config._experts_implementation = "eager"  # a loop over the experts hit: a sync each
    assert "'eager'" in (experts_graph_reason(model, fast.layers) or "")
    dense = build(*MOE_ARCHS["qwen2_moe_shared"])
    assert experts_graph_reason(dense, [layer for layer in _fast("qwen2_moe_shared")[1].layers[1:]]) is None


def _padded_steps(fast: FastLlama, graphs: DecodeGraphs, seqs: list[list[int]]) -> list[list[torch.Tensor]]:
    """Five sequences prefilled 4 tokens each, then decode steps of 5, 3 and 1 rows through `graphs` (the rows left
    out catch up eagerly): each step's rows' logits, in fp32."""
    fast.graphs = graphs
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(5)]
    prompt = 4
    fast.forward(StepInputs(chunks=[(tables[i], 0, seqs[i][:prompt]) for i in range(5)]))
    steps = []
    for step in range(prompt, 7):
        rows = [i for i in range(5) if step < len(seqs[i])][: (5, 3, 1)[step - prompt]]
        out = fast.forward(
            StepInputs(
                decode_ids=[seqs[i][step] for i in rows],
                decode_positions=[step] * len(rows),
                decode_tables=[tables[i] for i in rows],
                keep=list(range(len(rows))),
            )
        )
        steps.append([out[row].float().clone() for row in range(len(rows))])  # (the graphs reuse their buffer)
        for i in set(range(5)) - set(rows):
            fast.forward(StepInputs(chunks=[(tables[i], step, [seqs[i][step]])]))
    return steps


def _replay_counted(graphs: DecodeGraphs) -> list[int]:
    replayed: list[int] = []
    real_run = graphs.run
    graphs.run = lambda *a, **k: replayed.append(len(a[0])) or real_run(*a, **k)  # type: ignore[method-assign]
    return replayed


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
@torch.inference_mode()
def test_padded_decode_steps_over_the_graphs_give_each_rows_transformers_logits(monkeypatch, arch: str):
    """Five sequences prefilled, then decode steps of 5, 3 and 1 rows through the decode graphs' padded buffers
    (attention by the Triton kernel), played without capture in fp32: every row's logits are those of its whole
    sequence run alone through transformers. On CUDA, the same steps replayed from graphs captured in bfloat16
    give the logits of the same padded steps played eagerly in bfloat16 (same kernels, same shapes).

    Why not bfloat16 against transformers' bfloat16: on these tiny random mixtures the routers' top experts are
    near-tied, so two bfloat16 computations whose products differ in shape (ours pads decode rows to a capture
    size, and each expert's grouped product then holds other rows; transformers runs each sequence alone) round
    differently and can route a token to another expert, parting by far more than rounding (OLMoE's 0.56 on an
    H200, 2026-12-04). fp32 checks the arithmetic; the bfloat16 twin checks the capture."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, 512, (n,), generator=gen).tolist() for n in (9, 12, 7, 10, 8)]
    model, fast = _fast(arch)
    reference = [model(torch.tensor([s], device=DEVICE)).logits[0].float() for s in seqs]
    played = DecodeGraphs(fast, 8, SCRATCH, capture=False)
    counted = _replay_counted(played)
    for step, outs in enumerate(_padded_steps(fast, played, seqs), start=4):
        rows = [i for i in range(5) if step < len(seqs[i])][: len(outs)]
        for row, out in enumerate(outs):
            torch.testing.assert_close(out, reference[rows[row]][step], **CLOSE)
    assert counted == [5, 3, 1] and not played._graphs
    if not CAPTURE:
        return
    model, fast = _fast(arch, torch.bfloat16)
    twin = FastLlama(model, PagedKVCache(*_cache_shape(model), torch.bfloat16, DEVICE), 256)
    graphs = DecodeGraphs(fast, 8, SCRATCH, capture=True)
    counted = _replay_counted(graphs)
    captured = _padded_steps(fast, graphs, seqs)
    eager = _padded_steps(twin, DecodeGraphs(twin, 8, SCRATCH, capture=False), seqs)
    assert counted == [5, 3, 1] and not graphs.failed and graphs._graphs
    for step_captured, step_eager in zip(captured, eager, strict=True):
        for got, want in zip(step_captured, step_eager, strict=True):
            torch.testing.assert_close(got, want, **CAPTURED_CLOSE)


@pytest.mark.skipif(CAPTURE, reason="on CUDA the padded-step test captures the graphs in bfloat16")
@pytest.mark.parametrize("arch", ["qwen2_moe_shared", "qwen3_moe"])
def test_the_engine_over_the_graphs_gives_generates_greedy_tokens(tiny_model, monkeypatch, arch: str):
    """An engine on the fast path with decode graphs (their buffers played on a CPU, each step watched for a
    host sync): requests joining a running batch, prompts in chunks of 4, give `generate()`'s greedy tokens."""
    record = graphs_on_the_test_device(monkeypatch)
    loaded = dataclasses.replace(tiny_model, model=build(*MOE_ARCHS[arch]), max_context=256)
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 10))
    assert engine.runner.path == "fast" and record.steps
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 10)


@pytest.mark.parametrize(("arch", "path"), [("qwen3_moe", "generic"), ("gpt_oss", "fast")])
def test_lora_adapters_on_a_mixture_of_experts(tiny_model, tmp_path, arch, path):
    """lmiserve's forward applies adapters to attention and dense MLPs: with LoRA configured an MoE model takes
    transformers' forward (which hooks any linear), or where that cannot run it (gpt-oss's sinks) lmiserve's, with
    adapters of attention alone (its experts and router are no linears PEFT adapts); an adapter of q and v gives the
    merged model's tokens either way."""
    from helpers.lora_adapters import AdapterSpec, make_adapter, merged_generate, served_with_adapter
    from lmiserve.engine.lora.registry import LoraLimits

    base = tmp_path / arch
    build(*MOE_ARCHS[arch]).save_pretrained(base)
    adapter = make_adapter(base, tmp_path / "adapter", AdapterSpec("attn", 8, ("q_proj", "v_proj"), seed=4, b_std=0.3))
    loaded = dataclasses.replace(tiny_model, model=build(*MOE_ARCHS[arch]), max_context=256)
    prompts = [tiny_model.tokenizer(p).input_ids for p in PROMPTS[:2]]
    expected = merged_generate(base, adapter, prompts, 8)
    assert expected != merged_generate(base, None, prompts, 8)

    config = EngineConfig(lora=LoraLimits(max_loras=1))
    assert served_with_adapter(loaded, config, "attn", adapter, PROMPTS[:2], 8, path) == expected
    without = create_engine(loaded, EngineConfig())
    assert without.runner.path == "fast"


@pytest.mark.skipif(CAPTURE, reason="graphs of experts capture in bfloat16 alone; the padded-step test covers CUDA")
def test_a_vision_mixture_of_experts_serves_images_on_the_fast_forward(tiny_vlm_dir, monkeypatch):
    """Qwen3-VL's mixture of experts (Qwen3-VL-30B-A3B): its decoder on lmiserve's forward with decode graphs
    (played on a CPU), image requests and a text one joining in chunks of 8, `generate()`'s greedy tokens; every
    step on the fast forward, those that meet an image with their DeepStack features."""
    from helpers.vlm_serving import chat, config, image_of, prompt_of, reference, same, serve
    from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner
    from lmiserve.models.load import load_causal_lm

    record = graphs_on_the_test_device(monkeypatch)
    path = tiny_vlm_dir("qwen3_vl_moe")
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    requests = [
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),)),
        (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ()),
        (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),)),
    ]
    results, engine = asyncio.run(serve(loaded, config(max_prefill_tokens=8), requests))
    assert same(results, [reference(path, *r) for r in requests])
    runner = engine.executor.runner
    assert isinstance(runner, PagedFastVisionRunner) and runner.steps["fast"] > 0 and runner.steps["vlm"] == 0
    assert record.steps and record.shifted  # (M-RoPE's shifted text rows in the graphs)


def test_int4_serves_a_mixture_of_experts_and_says_its_experts_stay_unquantized(tiny_model, tmp_path, caplog):
    """`dtype=int4` quantizes the linear layers (attention, the shared expert): an MoE model loads, runs the fast
    forward, and the log says which share of its weights (the experts') it left as they were."""
    from lmiserve.models.load import load_causal_lm

    tiny_model.tokenizer.save_pretrained(tmp_path)
    build(*MOE_ARCHS["qwen2_moe_shared"]).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="lmiserve.models.load"):
        loaded = load_causal_lm(tmp_path, dtype="int4", device="cpu")
    assert any("experts' weights" in r.message and "stay float32" in r.message for r in caplog.records)
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 4))
    assert engine.runner.path == "fast" and all(len([e for e in events if e.token]) == 4 for events in results)


MATRICES = ("gate_proj", "up_proj", "down_proj")  # each expert's, as Qwen3-MoE publishes them


@pytest.mark.parametrize(
    "fmt",
    [
        "fp8-block",
        "fp8-channel",
        "fp8-tensor",
        "w4a16",
        "w4a16-asym",
        "w8a8",
        "modelopt-fp8",
        "modelopt-fp8-channel",
        "awq",
        "gptq",
        "awq-mixtral",
        "gptq-int8",
    ],
)
def test_a_quantized_mixture_of_experts_is_dequantized_and_served(tiny_model, tmp_path, fmt, monkeypatch):
    """A Qwen3-MoE checkpoint in fp8, every projection (each expert's matrices too) fp8 with a scale a block
    (Qwen3-30B-A3B-FP8's format), a row or the tensor (compressed-tensors', as llm-compressor publishes Qwen3-MoE and
    Mixtral; or by NVIDIA ModelOpt's export, FP8 and FP8_PER_CHANNEL_PER_TOKEN, each expert's matrices apart), or in
    compressed-tensors' integers (Qwen3-MoE's W4A16, each expert's matrices packed by the
    compressed-tensors package, or W8A8's int8), or in AWQ's or GPTQ's 4-bit codes (every projection, each expert's
    matrices too, as AutoAWQ and GPTQModel publish Qwen3-30B-A3B, and an AWQ Mixtral under its names ``w1``-``w3``: the
    router float): loaded with each expert's weights
    its stored values times their scales (integers: the package's own de-quantization; AWQ and GPTQ: their published
    unpacking), merged as transformers holds them, and served on the fast forward with `generate()`'s greedy
    tokens. (De-quantized, `cpu_experts.kept_for` turned off, as a CPU without numba does; kept on its kernels:
    test_cpu_experts.py.)"""
    from safetensors.torch import load_file

    from helpers.compressed_ints import decompressed
    from lmiserve.engine.model import cpu_experts

    monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)
    from helpers.modelopt_checkpoints import installed as modelopt_installed
    from helpers.published_unpacking import ref_awq, ref_gptq
    from helpers.quantizable import write_checkpoint
    from lmiserve.models.load import load_causal_lm

    if fmt.startswith("modelopt") and not modelopt_installed():
        pytest.skip("nvidia-modelopt, which writes ModelOpt's checkpoints, is not installed")
    mixtral = fmt.endswith("-mixtral")  # (Mixtral's names: ``block_sparse_moe.experts.{e}.w1``, ``w3``, ``w2``)
    fmt = fmt.removesuffix("-mixtral")
    write_checkpoint(build(*MOE_ARCHS["mixtral" if mixtral else "qwen3_moe"]), tmp_path, fmt, 16)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", MATRICES)

    def dequantized(name: str) -> torch.Tensor:
        if fmt in ("awq", "gptq", "gptq-int8"):
            t = {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(f"{name}.")}
            return ref_awq(t, 16) if fmt == "awq" else ref_gptq(t)
        if fmt.startswith("w"):
            return decompressed(
                fmt, 16, {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(f"{name}.")}
            )
        q = stored[f"{name}.weight"].float()
        if fmt != "fp8-block":  # (a scale a tensor, a row [out, 1], or ModelOpt's [out])
            scale = stored[f"{name}.weight_scale"]
            return q * (scale[:, None] if scale.dim() == 1 else scale)
        scale = stored[f"{name}.weight_scale_inv"]
        return (q.reshape(q.shape[0] // 16, 16, -1, 16) * scale[:, None, :, None]).reshape(q.shape)

    loaded = load_causal_lm(tmp_path, dtype="fp32", device="cpu")
    experts = loaded.model.model.layers[1].mlp.experts
    for e in (0, experts.gate_up_proj.shape[0] - 1):
        at = f"model.layers.1.{block}.experts.{e}"
        gate_up = torch.cat([dequantized(f"{at}.{gate}"), dequantized(f"{at}.{up}")])
        assert torch.equal(experts.gate_up_proj[e], gate_up) and torch.equal(
            experts.down_proj[e], dequantized(f"{at}.{down}")
        )
    if fmt.startswith("w") or fmt in ("awq", "gptq", "gptq-int8"):  # the attention's linears integers, router float
        codes = "weight" if fmt == "w8a8" else "weight_packed" if fmt.startswith("w") else "qweight"
        assert stored[f"model.layers.1.self_attn.q_proj.{codes}"].dtype in (torch.int8, torch.int32)
        assert stored[f"model.layers.1.{block}.gate.weight"].is_floating_point()
    loaded = dataclasses.replace(loaded, max_context=256)
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 8))
    assert engine.runner.path == "fast"
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 8)


def test_a_mixture_of_experts_whose_experts_are_stored_otherwise_is_refused_in_one_line(tiny_model, tmp_path):
    """A quantized Qwen3-MoE whose experts' matrices are under names lmiserve does not know (``gate_linear`` for
    ``gate_proj``): the start stops in one line naming the experts module, not a missing tensor's name."""
    from safetensors.torch import load_file, save_file

    from lmiserve.models.errors import ModelLoadError
    from lmiserve.models.load import load_causal_lm
    from lmiserve.models.quant_pack import write_quantized

    write_quantized(build(*MOE_ARCHS["qwen3_moe"]), tmp_path, "fp8-channel")
    tiny_model.tokenizer.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")  # the experts' matrices under other names
    save_file({k.replace("_proj.", "_linear.") if ".experts." in k else k: v for k, v in stored.items()},
              tmp_path / "model.safetensors")  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"the experts of model\.layers\.0\.mlp\.experts are not stored as"):
        load_causal_lm(tmp_path, dtype="fp32", device="cpu")
