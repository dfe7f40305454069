"""The fast Llama-family forward (engine/model/fast_llama.py) and how the runner picks it.

Tiny random models of each covered architecture (and one it does not cover) share the tiny
tokenizer. The fast forward must give transformers' logits; the engine must pick the fast path
by itself where it applies, fall back to the generic transformers path elsewhere (or when told
to), and give `model.generate`'s greedy tokens on every path.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from helpers.llama_variants import ARCHS, PROMPTS, build, generic_model, greedy_tokens, serve_prompts
from lmiserve.core.events import FinishReason
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention import backends, cpu_kernel
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache, paged_cache
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model import fast_llama, layer_ops
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs, unsupported_reason


def with_model(loaded, model):
    """`loaded` serving `model`, moved to its device (the test device: a GPU run's engines run there)."""
    return dataclasses.replace(loaded, model=model.to(loaded.device), max_context=256)


def test_which_models_the_fast_path_covers():
    for name, (cfg, cls, extra) in ARCHS.items():
        assert unsupported_reason(build(cfg, cls, extra)) is None, name
    assert "phi" in unsupported_reason(generic_model("phi"))
    odd = build(Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32})  # a key norm over the whole projection
    odd.model.layers[1].self_attn.k_norm = Qwen3RMSNorm(64)
    assert "norms" in unsupported_reason(odd)
    del odd.model.layers[1].self_attn.k_norm  # a query norm alone
    assert "norms" in unsupported_reason(odd)
    # sliding windows: the paged attention applies them (tests/unit/test_sliding_window.py)
    assert unsupported_reason(build(MistralConfig, MistralForCausalLM, {"sliding_window": 16})) is None
    dynamic = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
    assert "RoPE" in unsupported_reason(build(LlamaConfig, LlamaForCausalLM, dynamic))


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.inference_mode()
def test_one_ragged_step_gives_transformers_logits(arch: str):
    """Decode rows and prefill chunks of other sequences in one forward, each through its own blocks
    (scattered in the pool), equal each sequence run alone."""
    model = build(*ARCHS[arch])
    cfg = model.config
    rng = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 512, (n,), generator=rng).tolist() for n in (9, 14, 6)]
    reference = [model(torch.tensor([s])).logits[0] for s in seqs]
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        12,
        4,
        cfg.num_key_value_heads,
        AttentionShape.of(cfg).head_dim,
        model.dtype,
        model.device,
    )
    fast = FastLlama(model, cache, 256)
    tables = [[5, 0, 8], [2, 11, 1, 9], [4, 7]]  # 4 positions a block: 9, 14 and 6 positions
    # step 1: prefill sequence 0 but its last token (keeping every row), the first 5 tokens of sequence 1
    out = fast.forward(
        StepInputs(chunks=[(tables[0], 0, seqs[0][:-1]), (tables[1], 0, seqs[1][:5])], keep=[*range(13)])
    )
    torch.testing.assert_close(out[:8], reference[0][:8], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[8:], reference[1][:5], rtol=1e-4, atol=1e-4)
    # step 2: sequence 0 decodes its last token while sequence 1 finishes its prompt and sequence 2 starts
    out = fast.forward(
        StepInputs(
            [seqs[0][-1]],
            [8],
            [tables[0]],
            chunks=[(tables[1], 5, seqs[1][5:]), (tables[2], 0, seqs[2])],
            keep=[0, 9, 10 + 5],
        )
    )
    torch.testing.assert_close(out[0], reference[0][-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], reference[1][-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[2], reference[2][-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel_chunk", [0, 32, 64], ids=["chunks-sdpa", "chunks-mixed", "chunks-kernel"])
@torch.inference_mode()
def test_paged_prompt_chunks_after_a_long_prefix_give_transformers_logits(kernel_chunk: int, monkeypatch):
    """Over a block cache, a prompt computed in small chunks (each attending over the prefix in its
    blocks: the compiled kernel for short chunks on CPU fp32, gathered SDPA otherwise) beside decode rows
    gives each position's logits of the whole prompt run alone."""
    monkeypatch.setattr(backends, "KERNEL_CHUNK_TOKENS", kernel_chunk)
    model = build(*ARCHS["llama"])
    cfg = model.config
    rng = torch.Generator().manual_seed(1)
    long, short = (torch.randint(4, 512, (n,), generator=rng).tolist() for n in (70, 9))
    ref_long, ref_short = (model(torch.tensor([s])).logits[0] for s in (long, short))
    cache = PagedKVCache(cfg.num_hidden_layers, 24, 4, cfg.num_key_value_heads, 16, model.dtype, model.device)
    fast = FastLlama(model, cache, 256)
    long_table = [3, 7, 1, 12, 0, 9, 5, 14, 2, 11, 6, 8, 10, 16, 17, 18, 19, 20]  # 18 blocks of 4: 72 positions
    short_table = [23, 13, 4]
    # the short prompt but its last token, and the long one's first 40 tokens
    out = fast.forward(StepInputs(chunks=[(short_table, 0, short[:-1]), (long_table, 0, long[:40])], keep=[7, 8 + 39]))
    torch.testing.assert_close(out[0], ref_short[7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref_long[39], rtol=1e-4, atol=1e-4)
    # then the long prompt in chunks of 10, each beside the short one's last token (the same position
    # every step: it writes the same key and value again and must read the same logits)
    for start in range(40, len(long), 10):
        chunk = long[start : start + 10]
        keep = list(range(1 + len(chunk)))
        step = StepInputs([short[-1]], [len(short) - 1], [short_table], chunks=[(long_table, start, chunk)], keep=keep)
        out = fast.forward(step)
        torch.testing.assert_close(out[0], ref_short[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1:], ref_long[start : start + len(chunk)], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_fusing_weights_keeps_the_transformers_model_working_without_copies():
    model = build(*ARCHS["qwen2_bias"])
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    params_before = sum(p.numel() for p in model.parameters())
    fast = FastLlama(model, paged_cache(model, 4, 4), 256)
    torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)  # same math, other GEMM layout
    assert sum(p.numel() for p in model.parameters()) == params_before
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == fast.layers[0].qkv_w[attn.q_proj.weight.shape[0] :].data_ptr()
    assert fast.layers[0].qkv_w.is_contiguous()  # one [out, in] matrix (the model's own layout)


@pytest.mark.parametrize(
    "arch, config, path",
    [
        ("tiny", {}, "fast"),
        ("tiny", {"fast_path": False}, "generic"),  # transformers' forward over the blocks
        ("tiny", {"max_running": 2, "max_prefill_tokens": 3}, "fast"),  # queueing, chunks, preemption-free
        ("tiny", {"max_running": 2, "max_prefill_tokens": 3, "fast_path": False}, "generic"),
        ("qwen3", {"max_prefill_tokens": 4}, "fast"),  # its heads' norms in the fast forward
        ("qwen3", {"fast_path": False}, "generic"),
        ("phi3_window", {"max_prefill_tokens": 4}, "fast"),  # qkv_proj and gate_up_proj
        ("smollm3_nope", {"max_prefill_tokens": 4}, "fast"),  # a layer without RoPE
        ("granite", {"max_prefill_tokens": 4}, "fast"),  # its multipliers
        ("ministral_window", {"max_prefill_tokens": 4}, "fast"),  # a window on one layer of two
        ("seed_oss_bias", {"max_prefill_tokens": 4}, "fast"),  # biases everywhere
        ("gemma", {"max_prefill_tokens": 4}, "fast"),  # (1 + w) norms, a scaled embedding, GELU
        ("gemma3_window", {"max_prefill_tokens": 4}, "fast"),  # sandwich norms, two RoPE tables, soft cap
        ("gemma3_window", {"fast_path": False}, "generic"),
        ("olmo2", {"max_prefill_tokens": 4}, "fast"),  # norms of the outputs alone, of the whole q and k
        ("olmo3_window", {"max_prefill_tokens": 4}, "fast"),
        ("exaone4_window", {"max_prefill_tokens": 4}, "fast"),  # no RoPE on the full layer
        ("starcoder2_window", {"max_prefill_tokens": 4}, "fast"),  # LayerNorms, an MLP without a gate
        ("phi4_mini_longrope", {"max_prefill_tokens": 4}, "fast"),  # 3/4 of each head rotated, LongRoPE
        ("glm", {"max_prefill_tokens": 4}, "fast"),  # RoPE by pairs over half of each head
        ("glm4", {"max_prefill_tokens": 4}, "fast"),  # and the outputs' norms
        ("mixtral", {"max_prefill_tokens": 4}, "fast"),  # a mixture of experts: the model's own block
        ("qwen2_moe_shared", {"max_prefill_tokens": 4}, "fast"),  # a shared expert beside; a dense layer
        ("qwen3_moe", {"max_prefill_tokens": 4}, "fast"),
        ("qwen3_moe", {"fast_path": False}, "generic"),
        ("glm4_moe", {"max_prefill_tokens": 4}, "fast"),  # grouped sigmoid routing, a shared expert, half rotated
        ("olmoe", {"max_prefill_tokens": 4}, "fast"),  # norms of the whole q and k projections
        ("gemma2_window", {"max_prefill_tokens": 4}, "fast"),  # soft-capped attention scores (torch ops on a CPU)
        ("gpt_oss", {"max_prefill_tokens": 4}, "fast"),  # attention sinks (torch ops on a CPU), windows, experts
        ("phi", {"max_prefill_tokens": 4}, "generic"),  # not covered by the fast forward: transformers'
        ("gpt2", {}, "generic"),
        ("qwen2_bias", {"max_prefill_tokens": 4}, "fast"),
        ("tiny", {"batch_invariant": True}, "batch_invariant"),  # each row alone, over its blocks
    ],
)
def test_every_path_gives_generates_greedy_tokens(tiny_model, arch: str, config: dict, path: str):
    if arch in ("phi", "gpt2"):
        loaded = with_model(tiny_model, generic_model(arch))
    elif arch != "tiny":
        loaded = with_model(tiny_model, build(*ARCHS[arch]))
    else:
        loaded = tiny_model
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(**config), 12))
    assert engine.runner.path == path
    assert engine.pool.num_blocks == engine.runner.num_blocks  # the scheduler's pool books the runner's blocks
    for prompt, events in zip(PROMPTS, results):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 12)
        assert events[-1].finish.reason is FinishReason.LENGTH


def test_a_model_whose_attention_ignores_the_paged_cache_is_refused(tiny_model):
    """A forward that never hands its keys and values to the cache would attend within the step only:
    the start-up probe finds it and the engine refuses the model (there is no other KV layout)."""
    from types import SimpleNamespace

    from lmiserve.engine.runner import generic as paged_generic

    config = build(*ARCHS["llama"]).config

    class Ignoring(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config, self.dtype, self.device = config, torch.float32, torch.device("cpu")

        def forward(self, input_ids, **kwargs):
            return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], config.vocab_size))

    assert "attention functions" in (paged_generic.unsupported_reason(Ignoring()) or "")
    with pytest.raises(ValueError, match="cannot be served.*attention functions"):
        create_engine(with_model(tiny_model, Ignoring()), EngineConfig(fast_path=False))


def test_sliding_window_models_are_served_over_blocks():
    """Their attention applies the window over the paged cache only (tests/unit/test_sliding_window.py)."""
    from lmiserve.engine.runner import generic as paged_generic

    windowed = build(MistralConfig, MistralForCausalLM, {"sliding_window": 16})
    assert paged_generic.unsupported_reason(windowed) is None
    assert unsupported_reason(windowed) is None
    assert paged_generic.unsupported_reason(build(*ARCHS["mistral_no_window"])) is None


def test_prompt_logprobs_are_the_same_on_the_fast_and_generic_paths(tiny_model):
    _, fast = asyncio.run(serve_prompts(tiny_model, EngineConfig(max_prefill_tokens=4), 3, details=True))
    _, generic = asyncio.run(
        serve_prompts(tiny_model, EngineConfig(max_prefill_tokens=4, fast_path=False), 3, details=True)
    )
    for a, b in zip(fast, generic):
        pa, pb = a[-1].finish.prefill, b[-1].finish.prefill
        assert [t.id for t in pa] == [t.id for t in pb] and pa[0].logprob is None
        assert [t.logprob for t in pa[1:]] == pytest.approx([t.logprob for t in pb[1:]], abs=1e-4)


def test_a_step_with_newcomers_is_one_forward(tiny_model, monkeypatch):
    calls = []
    real = FastLlama.forward

    def counted(self, step: StepInputs):
        calls.append((len(step.decode_ids), len(step.chunks)))
        return real(self, step)

    monkeypatch.setattr(FastLlama, "forward", counted)
    engine = create_engine(tiny_model, EngineConfig())  # driven step by step, no event loop
    calls.clear()  # on CUDA, create_engine profiles the memory of its largest step: one forward
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=5, ignore_eos_token=True)

    def step():  # the engine's own hand-over: the plan's plain-data batch through its executor
        plan, _ = sched.schedule(0.0)
        return plan, sched.update(plan, engine.executor.collect(engine._launch(plan)))

    engine.submit(GenerationRequest(PROMPTS[0], params))
    step()  # prefill the first prompt
    engine.submit(GenerationRequest(PROMPTS[1], params))
    engine.submit(GenerationRequest(PROMPTS[2], params))
    plan, events = step()
    assert len(plan.decode) == 1 and len(plan.prefill) == 2
    assert calls == [(0, 1), (1, 2)]  # one forward per step, decode rows and both newcomers together
    assert len(events) == 3 and all(e.token is not None for _, e in events)


def test_a_failing_fused_forward_fails_only_the_culprit(tiny_model, monkeypatch):
    bad_ids = tiny_model.tokenizer(PROMPTS[1]).input_ids
    real = FastLlama.forward

    def forward(self, step: StepInputs):
        if any(chunk == bad_ids[start : start + len(chunk)] for _, start, chunk in step.chunks):
            raise RuntimeError("kernel exploded")
        return real(self, step)

    monkeypatch.setattr(fast_llama.FastLlama, "forward", forward)
    _, results = asyncio.run(serve_prompts(tiny_model, EngineConfig(), 6))
    for prompt, events in zip(PROMPTS, results):
        if prompt == PROMPTS[1]:
            assert events[-1].finish.reason is FinishReason.ERROR
            assert "kernel exploded" in events[-1].finish.error
        else:
            assert [e.token.id for e in events if e.token] == greedy_tokens(tiny_model, prompt, 6)


def test_engine_settings_reach_the_runner_and_the_scheduler(tiny_model):
    from lmiserve.config import Settings
    from lmiserve.engine.factory import PREFILL_FLOOR
    from lmiserve.models.compose import build_engine

    default = build_engine(tiny_model, Settings())
    assert default.runner.path == "fast"
    assert default.scheduler.prefill_floor == PREFILL_FLOOR[tiny_model.device.type]  # 16 on CPU
    generic = build_engine(
        tiny_model, Settings.from_options({"fast_path": "false", "prefill_tokens_while_decoding": "64"})
    )
    assert generic.runner.path == "generic" and generic.scheduler.prefill_floor == 64
    # a second engine on the same model reuses the fused weights instead of fusing (and copying) again
    assert build_engine(tiny_model, Settings()).runner.fast.layers is default.runner.fast.layers


@pytest.mark.parametrize("arch", ["llama", "gemma3_window", "olmo2", "qwen3_moe", "olmoe", "gpt_oss"])
@torch.inference_mode()
def test_bf16_models_run_on_the_fast_path_close_to_transformers(arch: str):
    model = build(*ARCHS[arch]).to(torch.bfloat16)
    ids = [5, 9, 17, 33, 65, 129, 257, 300]
    reference = model(torch.tensor([ids])).logits[0].float()
    cache = paged_cache(model, 4, 4)
    fast = FastLlama(model, cache, 256)
    table = [3, 1]  # 4 positions a block: 8 positions
    fast.forward(StepInputs(chunks=[(table, 0, ids[:-1])]))
    out = fast.forward(StepInputs([ids[-1]], [len(ids) - 1], [table], keep=[0]))
    assert out.dtype == torch.float32 and cache.keys[0].dtype == torch.bfloat16
    assert int(out[0].argmax()) == int(reference[-1].argmax())
    torch.testing.assert_close(out[0], reference[-1], rtol=0.05, atol=0.1)


@torch.inference_mode()
def test_gemmas_norms_and_embeddings_round_as_transformers_do_in_bf16():
    """Gemma's norms apply ``1 + w`` in float32 before the cast back (Llama's after it), and its embeddings'
    factor is rounded to the weights' dtype (sqrt(3072) is 55.5 in bf16): bit for bit transformers'."""
    model = build(*ARCHS["gemma3_window"]).to(torch.bfloat16)
    model.model.embed_tokens.embed_scale = torch.tensor(3072**0.5)  # Gemma 3 4B's hidden size
    fast = FastLlama(model, paged_cache(model, 4, 4), 256)
    layer, fused = model.model.layers[0], fast.layers[0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    assert torch.equal(layer_ops.rms_norm(x, fused.in_norm), layer.input_layernorm(x))
    assert torch.equal(layer_ops.rms_norm(x, fused.out_norms[1]), layer.post_feedforward_layernorm(x))
    q = x[:, :32].reshape(5, 1, 32)
    assert torch.equal(layer_ops.rms_norm(q, (fused.head_norms[0], fused.head_norms[2])), layer.self_attn.q_norm(q))
    ids = torch.tensor([5, 9, 300])
    assert fast.multipliers.embedding == 55.5
    assert torch.equal(torch.nn.functional.embedding(ids, fast.embed) * 55.5, model.model.embed_tokens(ids))


@pytest.mark.parametrize("context", [300, 600], ids=["within-original", "past-original"])
@torch.inference_mode()
def test_longrope_takes_its_short_or_long_factors_from_the_served_context(context: int):
    """LongRoPE (Phi-3.5-mini, Phi-4-mini; here over 3/4 of each head) with an original length of 300 (past the
    first 256 positions a table is built for): served within it, the short factors (transformers' for a sequence
    within it); served past it, the long factors at every position (transformers' for a sequence past it), as
    vLLM chooses them."""
    from helpers.llama_variants import LONGROPE

    model = build(Phi3Config, Phi3ForCausalLM, {**LONGROPE, "original_max_position_embeddings": 300})
    length = 300 if context == 300 else 310
    seq = torch.randint(4, 512, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    reference = model(torch.tensor([seq])).logits[0]
    fast = FastLlama(model, paged_cache(model, 84, 4), context)
    assert fast.rope.rotary_dim == 12 and fast.packed is None and not fast.fused_elementwise
    table = list(range(78))
    out = fast.forward(StepInputs(chunks=[(table, 0, seq[:12])], keep=list(range(12))))  # a table of 256 rows
    torch.testing.assert_close(out, reference[:12], rtol=1e-4, atol=1e-4)
    out = fast.forward(StepInputs(chunks=[(table, 12, seq[12:-1])], keep=list(range(length - 13))))
    torch.testing.assert_close(out, reference[12:-1], rtol=1e-4, atol=1e-4)
    out = fast.forward(StepInputs([seq[-1]], [length - 1], [table], keep=[0]))
    torch.testing.assert_close(out[0], reference[-1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_olmo2s_norms_round_as_transformers_do_in_bf16():
    """OLMo 2's norms apply their weight before the cast back, over the whole q and k projections too."""
    model = build(*ARCHS["olmo2"]).to(torch.bfloat16)
    fast = FastLlama(model, paged_cache(model, 4, 4), 256)
    layer, fused = model.model.layers[1], fast.layers[1]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    assert fused.in_norm is None and fused.post_norm is None
    assert torch.equal(layer_ops.rms_norm(x, fused.out_norms[0]), layer.post_attention_layernorm(x))
    assert torch.equal(layer_ops.rms_norm(x, fused.proj_norms[0]), layer.self_attn.q_norm(x))
    assert torch.equal(layer_ops.rms_norm(x[:, :32], fused.proj_norms[1]), layer.self_attn.k_norm(x[:, :32]))


@pytest.mark.parametrize("attention", ["compiled", "torch"])
@pytest.mark.parametrize("rows", [5, 11, 17])
@torch.inference_mode()
def test_decode_rows_padded_to_a_multiple_of_eight_give_each_rows_logits(rows: int, attention: str):
    """On CPU a step pads its rows (and the rows it keeps) to a multiple of 8 (past the few rows the
    few-row kernel takes unpadded); the padding never shows.
    Every decode attention over the blocks gives each row its own logits: the compiled kernel (CPU fp32)
    and the torch path (GPU, bf16: a gather of the rows' blocks, masked past each row's span)."""
    model = build(*ARCHS["llama"])
    cfg = model.config
    rng = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, 512, (3 + i % 7,), generator=rng).tolist() for i in range(rows)]
    reference = [model(torch.tensor([s])).logits[0, -1] for s in seqs]
    cache = PagedKVCache(cfg.num_hidden_layers, 3 * rows, 4, cfg.num_key_value_heads, 16, model.dtype, model.device)
    fast = FastLlama(model, cache, 256, compiled_attention_ok=attention == "compiled")
    assert fast.compiled_attention == (attention == "compiled")
    padded = 0 if rows <= fast.gemm.few_rows else (-rows) % 8
    assert fast.gemm.row_padding(rows, fast_llama.PAD_ROWS_FROM) == padded
    # at most 9 positions a row: 3 blocks of 4, row i's in reverse order from the end of the pool
    tables = [[3 * rows - 1 - 3 * i - j for j in range(3)] for i in range(rows)]
    fast.forward(StepInputs(chunks=[(tables[i], 0, s[:-1]) for i, s in enumerate(seqs)]))
    out = fast.forward(StepInputs([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables, keep=[*range(rows)]))
    assert out.shape == (rows, cfg.vocab_size)
    torch.testing.assert_close(out, torch.stack(reference), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("as_rows", [True, False], ids=["chunks-as-decode-rows", "a-kernel-call-a-chunk"])
@pytest.mark.parametrize("few_rows", [9, 0], ids=["few-row-kernel", "blas"])
@torch.inference_mode()
def test_paged_draft_chunks_give_every_positions_logits(as_rows: bool, few_rows: int, monkeypatch):
    """Draft verification over a block cache: requests' chunks of 2-9 tokens (the last token and the
    drafts, every logit kept) beside a decode row and behind a long prompt chunk give each position's
    logits of the sequence run alone, whether the short chunks join the decode kernel's rows (those
    before the long chunk) or attend a chunk at a time, and whether few-row products run through the
    few-row kernel or BLAS."""
    monkeypatch.setattr(backends, "CHUNKS_AS_DECODE_ROWS", as_rows)
    model = build(*ARCHS["llama"])
    cache = PagedKVCache(model.config.num_hidden_layers, 44, 4, model.config.num_key_value_heads, 16, model.dtype)
    fast = FastLlama(model, cache, 256)
    fast.use_kernels(fast.gemm.with_(few_rows=few_rows), fast.compiled_attention)
    _check_a_verification_step(model, fast, 1e-4, 1e-4)


@pytest.mark.parametrize("attention", ["compiled", "torch"])
@torch.inference_mode()
def test_bf16_decode_rows_and_draft_chunks_give_transformers_logits_through_either_attention(attention: str):
    """A bf16 model's KV cache is bf16. Its decode rows and short chunks run through the compiled kernel
    (which reads the cache's bits, with fp32 arithmetic) where it is allowed, else through the torch ops:
    either gives each position's logits of transformers' bf16 model run alone, within bf16's rounding."""
    model = build(*ARCHS["llama"]).to(torch.bfloat16)
    cache = PagedKVCache(model.config.num_hidden_layers, 44, 4, model.config.num_key_value_heads, 16, model.dtype)
    fast = FastLlama(model, cache, 256, compiled_attention_ok=attention == "compiled")
    assert fast.compiled_attention == (attention == "compiled") and cache.keys[0].dtype == torch.bfloat16
    _check_a_verification_step(model, fast, 0.05, 0.1)  # as the bf16 test above


def _check_a_verification_step(model: torch.nn.Module, fast: FastLlama, rtol: float, atol: float) -> None:
    """One step of a decode row, two short chunks (drafts being verified), a long prompt chunk and a chunk
    after it, against each sequence run alone through transformers."""
    rng = torch.Generator().manual_seed(2)
    seqs = [torch.randint(4, 512, (n,), generator=rng).tolist() for n in (30, 25, 20, 50)]
    refs = [model(torch.tensor([s])).logits[0].float() for s in seqs]
    tables = [list(range(i * 10, i * 10 + 8)) for i in range(3)] + [list(range(30, 43))]  # 4 positions a block
    starts = [21, 23, 11]  # what each sequence has in its blocks before this step
    fast.forward(StepInputs(chunks=[(tables[i], 0, seqs[i][: starts[i]]) for i in range(3)]))
    # seq 0 decodes one token; seq 1 verifies a chunk of 2, seq 2 one of 9 (the last 9 of 20), both before
    # seq 3's first 40 prompt tokens (a long chunk), then seq 0's next 5 tokens after it
    out = fast.forward(
        StepInputs(
            [seqs[0][21]],
            [21],
            [tables[0]],
            chunks=[
                (tables[1], 23, seqs[1][23:25]),
                (tables[2], 11, seqs[2][11:20]),
                (tables[3], 0, seqs[3][:40]),
                (tables[0], 22, seqs[0][22:27]),
            ],
            keep=[0, 1, 2, *range(3, 12), 12 + 39, *range(52, 57)],
        )
    )
    assert out.shape == (1 + 2 + 9 + 1 + 5, model.config.vocab_size)
    torch.testing.assert_close(out[0], refs[0][21], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[1:3], refs[1][23:25], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[3:12], refs[2][11:20], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[12], refs[3][39], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[13:], refs[0][22:27], rtol=rtol, atol=atol)


@torch.inference_mode()
def test_a_kernel_that_cannot_compile_falls_back_to_the_torch_attention(monkeypatch):
    def broken(dtype: torch.dtype = torch.float32) -> None:
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(cpu_kernel, "warm_up", broken)
    model = build(*ARCHS["llama"])
    fast = FastLlama(model, paged_cache(model, 4, 2), 64)
    assert not fast.compiled_attention and isinstance(fast.attention, backends.TorchBackend)
    tables = [[2, 0], [1, 3]]  # 2 positions a block
    fast.forward(StepInputs(chunks=[(tables[0], 0, [5, 6, 7]), (tables[1], 0, [8, 9])]))
    out = fast.forward(StepInputs([8, 10], [3, 2], tables, keep=[0, 1]))
    reference = model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1]
    torch.testing.assert_close(out[0], reference, rtol=1e-4, atol=1e-4)


ADAPTED = {  # Phi-3's q/k/v and gate/up one linear each; Starcoder2's MLP without a gate; GLM-4's gate/up one
    "phi3_window": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "starcoder2_window": ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"),
    "glm4": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),  # q/k/v apart, gate/up one
}


@pytest.mark.parametrize("arch", list(ADAPTED))
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_an_adapter_on_other_linears_names_gives_the_merged_models_tokens(
    tiny_model, tmp_path, monkeypatch, graphs, arch
):
    """Phi-3's q/k/v and gate/up are one linear each (`qkv_proj`, `gate_up_proj`), Starcoder2's MLP is `c_fc`
    and `c_proj`: a PEFT adapter on every linear rides the fast forward's LoRA groups, eagerly and over the decode
    graphs' adapter slots (played on a CPU), and gives `generate()`'s tokens with the adapter merged by PEFT."""
    from helpers.decode_graphs import graphs_on_the_test_device
    from helpers.lora_adapters import AdapterSpec, make_adapter, merged_generate, served_with_adapter
    from lmiserve.engine.lora.registry import LoraLimits

    record = graphs_on_the_test_device(monkeypatch) if graphs else None

    base = tmp_path / arch
    build(*ARCHS[arch]).save_pretrained(base)
    spec = AdapterSpec("phi", 8, ADAPTED[arch], seed=4, b_std=0.3)
    adapter = make_adapter(base, tmp_path / "adapter", spec)
    loaded = with_model(tiny_model, build(*ARCHS[arch]))
    prompts = [tiny_model.tokenizer(p).input_ids for p in PROMPTS[:3]]
    expected = merged_generate(base, adapter, prompts, 10, tiny_model.device)
    assert expected != merged_generate(base, None, prompts, 10, tiny_model.device)

    config = EngineConfig(lora=LoraLimits(max_loras=1), max_prefill_tokens=4)
    assert served_with_adapter(loaded, config, "phi", adapter, PROMPTS[:3], 10, "fast") == expected
    if record is not None:  # (decode steps with the adapter replayed the graphs)
        assert max(adapters for _, adapters in record.steps) == 1


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_gemma2_loads_without_sdpa_and_serves_on_the_fast_path(tiny_model, tmp_path, load_format: str, caplog):
    """Gemma 2 implements no SDPA attention (its scores are soft-capped): a checkpoint and a dummy of its shape
    load with its own attention (said in the log), and its steps run lmiserve's forward with the cap."""
    from lmiserve.models.load import load_causal_lm

    tiny_model.tokenizer.save_pretrained(tmp_path)
    build(*ARCHS["gemma2_window"]).save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="lmiserve.models.load"):
        loaded = load_causal_lm(tmp_path, dtype="fp32", device="cpu", load_format=load_format)
    assert any("does not support SDPA" in r.message for r in caplog.records)
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 6))
    assert engine.runner.path == "fast" and engine.runner.fast.attention.softcap == 2.0
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 6)
