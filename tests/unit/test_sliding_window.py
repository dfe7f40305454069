"""Sliding-window attention over the paged KV cache (engine/attention/windows.py): a layer with window W lets
the token at position q see positions q-W+1..q only, as transformers' masks do.

Tiny seeded models saved and loaded as a user's would be (`load_causal_lm`), each with a window of 16 and
prompts longer than it (59 tokens), must give `generate()`'s greedy tokens on every attention path the paged
engine takes for them: the fast forward (its compiled CPU kernel for decode rows and short chunks, SDPA for
long chunks, the torch decode path, the Triton kernel under its interpreter) and the generic runner over
transformers' attention (one mask for Mistral, one a layer kind for Qwen2's `max_window_layers` and Gemma 3's
mixed layers); alone, in a batch, in chunks and from the prefix cache. The slot cache, which applies no
window, refuses them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention import cpu_kernel
from lmiserve.engine.attention import paged as paged_attention
from lmiserve.engine.attention import windows as attention_window
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.engine.runner.generic import PagedGenericRunner
from lmiserve.engine.speculative.proposers import SpeculationSettings
from lmiserve.models.load import LoadedModel, load_causal_lm

# benchmarks/gpu_check.py runs these on the GPU (LMISERVE_TEST_DEVICE=cuda: the Triton kernel, CUDA graphs)
DEVICE = os.environ.get("LMISERVE_TEST_DEVICE", "cpu")
WINDOW = 16
TOKENS = 24
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    sliding_window=WINDOW,
)
MODELS = {
    # every layer windowed
    "mistral": (MistralConfig, MistralForCausalLM, {"num_hidden_layers": 2}),
    # layers from max_window_layers on windowed: layer 0 full, layers 1-2 windowed
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"num_hidden_layers": 3, "use_sliding_window": True, "max_window_layers": 1},
    ),
    # sliding layers beside a full one (each kind of layer with its own RoPE table)
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "tie_word_embeddings": False,  # tied, the tiny model repeats one token whatever it attends to
        },
    ),
}
TEXT = (
    "The quick brown fox jumps over the lazy dog. Deep learning is a subfield of machine learning that uses "
    "neural networks. What is the capital of France? The capital of France is Paris. Once upon a time there was "
    "a little model that generated text one token at a time. Numbers like 1, 2, 3, 42 and 2024 appear in text too. "
    "Continuous batching lets new requests join a running batch between decoding steps."
)


def _save(name: str, out: Path) -> Path:
    config_cls, model_cls, extra = MODELS[name]
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(7)
    model = model_cls(config_cls(vocab_size=len(tokenizer), **COMMON, **extra)).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(MODELS))
def windowed(request, tmp_path_factory) -> tuple[str, LoadedModel]:
    """A tiny windowed model as a user loads it (window 16)."""
    name = request.param
    return name, load_causal_lm(_save(name, tmp_path_factory.mktemp(name)), dtype="fp32", device=DEVICE)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> LoadedModel:
    return load_causal_lm(_save("mistral", tmp_path_factory.mktemp("mistral")), dtype="fp32", device=DEVICE)


def _prompt(loaded: LoadedModel, length: int, skip: int = 0) -> list[int]:
    ids = loaded.tokenizer(TEXT).input_ids
    assert len(ids) >= length + skip
    return ids[:1] + ids[1 + skip : length + skip]


def _reference(loaded: LoadedModel, prompt: list[int], tokens: int = TOKENS) -> list[int]:
    ids = torch.tensor([prompt], device=loaded.model.device)
    with torch.inference_mode():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=3,
        )
    return out[0, len(prompt) :].tolist()


async def _serve(loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]], *, one_by_one: bool = False):
    """Each prompt's greedy tokens and cached prompt tokens; the engine (stopped). Prompts join a running
    batch (a little apart), or with `one_by_one` each after the one before finished."""
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int, prompt: list[int]) -> tuple[list[int], int]:
        if not one_by_one:
            await asyncio.sleep(0.01 * i)
        params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
        events = [e async for e in engine.generate(GenerationRequest("", params, prompt_ids=prompt))]
        finish = events[-1].finish
        assert finish is not None and finish.error is None, finish
        return [e.token.id for e in events if e.token is not None], finish.cached_tokens

    try:
        if one_by_one:
            return [await one(i, p) for i, p in enumerate(prompts)], engine
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))), engine
    finally:
        await engine.stop()


def test_which_layers_have_a_window():
    def config(name: str, **extra):
        config_cls, _, base = MODELS[name]
        return config_cls(vocab_size=64, **{**COMMON, **base, **extra})

    assert attention_window.layer_windows(config("mistral")) == (WINDOW, WINDOW)
    assert attention_window.layer_windows(config("mistral", sliding_window=None)) == (None, None)
    assert attention_window.layer_windows(config("qwen2")) == (None, WINDOW, WINDOW)
    assert attention_window.layer_windows(config("qwen2", use_sliding_window=False)) == (None, None, None)
    assert attention_window.layer_windows(config("gemma3")) == (WINDOW, None, WINDOW)
    # transformers' meaning: the query at q sees q-W+1..q (W positions, its own included)
    seen = attention_window.visible(torch.tensor([20]), torch.arange(21), 16)[0]
    assert seen.nonzero().flatten().tolist() == list(range(5, 21))


def test_the_window_changes_the_answer(windowed):
    """Full attention answers otherwise (what the slot cache gave): the tests below tell the two apart."""
    name, loaded = windowed
    config = loaded.model.config
    full = type(loaded.model)(type(config)(**{**config.to_dict(), "sliding_window": 1000})).eval()
    full.load_state_dict(loaded.model.state_dict())
    for prompt in (_prompt(loaded, 59), _prompt(loaded, 9)):  # the short one outgrows the window as it decodes
        assert _reference(loaded, prompt) != _reference(dataclasses.replace(loaded, model=full), prompt), name


FAST_CONFIGS = {
    "one_chunk": {},  # the 59-token prompt in one chunk: SDPA over the gathered blocks
    "chunked": {"max_prefill_tokens": 8},  # short chunks: rows of the compiled decode kernel
    "long_chunks": {"max_prefill_tokens": 40},  # a chunk after a chunk past the window, SDPA
    "blocks_of_4": {"max_prefill_tokens": 12, "block_size": 4},
    # prompt-lookup drafts verified as short chunks past the window
    "ngram_drafts": {"speculation": SpeculationSettings("ngram", 4, 1, 3, disable_by_batch_size=8)},
}


@pytest.mark.parametrize("config", list(FAST_CONFIGS))
def test_greedy_tokens_equal_generates_alone_and_in_a_batch(windowed, config: str):
    name, loaded = windowed
    prompts = [_prompt(loaded, 59), _prompt(loaded, 30, skip=5), _prompt(loaded, 70, skip=2), _prompt(loaded, 9)]
    results, engine = asyncio.run(_serve(loaded, EngineConfig(**FAST_CONFIGS[config]), prompts))
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == _reference(loaded, prompt), (name, config, len(prompt))
    assert type(engine.runner) is PagedFastRunner
    if config == "ngram_drafts":
        info = engine.snapshot().speculation
        assert info is not None and info["num_drafts"] > 0, info


def test_the_generic_runner_over_blocks_applies_the_window(windowed):
    name, loaded = windowed
    prompts = [_prompt(loaded, 59), _prompt(loaded, 33, skip=4)]
    results, engine = asyncio.run(_serve(loaded, EngineConfig(fast_path=False, max_prefill_tokens=24), prompts))
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == _reference(loaded, prompt), (name, len(prompt))
    assert type(engine.runner) is PagedGenericRunner


def test_a_prefix_cache_hit_reads_the_window_from_shared_blocks(windowed):
    """The second prompt shares the first's first 48 tokens (3 blocks): its prefill starts past the window
    of its first tokens, reading the cached blocks."""
    name, loaded = windowed
    first = _prompt(loaded, 59)
    second = first[:48] + _prompt(loaded, 20, skip=30)[1:]
    results, _ = asyncio.run(_serve(loaded, EngineConfig(), [first, second, first], one_by_one=True))
    assert [cached for _, cached in results] == [0, 48, 48]  # whole blocks of the prompt
    for prompt, (tokens, _) in zip([first, second, first], results, strict=True):
        assert tokens == _reference(loaded, prompt), name


def test_the_torch_attention_applies_the_window(mistral, monkeypatch):
    """Where neither kernel applies (the compiled one: fp32 CPU; Triton: CUDA): the torch decode path and SDPA
    for chunks."""
    monkeypatch.setattr(cpu_kernel, "available", lambda dtype, device: False)
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "torch")
    prompts = [_prompt(mistral, 59), _prompt(mistral, 21, skip=3)]
    results, engine = asyncio.run(_serve(mistral, EngineConfig(max_prefill_tokens=8), prompts))
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == _reference(mistral, prompt)
    assert type(engine.runner) is PagedFastRunner


def test_the_triton_kernel_applies_the_window(mistral, monkeypatch):
    pytest.importorskip("triton")
    from lmiserve.engine.attention import triton_ops as triton_attention

    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    if not triton_attention.chosen(mistral.device):
        pytest.skip("the Triton kernel needs CUDA or its interpreter")
    prompts = [_prompt(mistral, 59), _prompt(mistral, 21, skip=3)]
    for config in (EngineConfig(max_prefill_tokens=24), EngineConfig(max_prefill_tokens=24, fast_path=False)):
        results, engine = asyncio.run(_serve(mistral, config, prompts))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == _reference(mistral, prompt), config
        runner = engine.runner
        assert runner.fast.triton if config.fast_path else runner.kernel  # the kernel, not the gather


# (bf16 on a GPU only: Triton's interpreter multiplies bf16 wrongly, see tests/unit/test_triton_attention.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_the_triton_kernel_masks_each_token_before_its_window(dtype: torch.dtype):
    """Tiles whose tokens' windows start in different key tiles (a 50-token chunk), a decode row, a chunk
    shorter than the window, against attention computed directly over each token's window."""
    pytest.importorskip("triton")
    from lmiserve.engine.attention import triton_ops as triton_attention

    if not (triton_attention.available(torch.device("cuda")) or triton_attention.interpreting()):
        pytest.skip("the Triton kernel needs CUDA or its interpreter")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    gen = torch.Generator().manual_seed(1)
    kv_heads, groups, dim, block_size, window = 2, 2, 16, 16, 13
    spans = [(40, 1), (3, 50), (70, 9), (0, 5)]  # (start, tokens)
    tables = _blocks([start + count for start, count in spans], block_size, gen)
    shape = (tables.numel() + 1, kv_heads, block_size, dim)
    keys = torch.randn(shape, generator=gen).to(device, dtype)
    values = torch.randn(shape, generator=gen).to(device, dtype)
    tokens = sum(count for _, count in spans)
    query = torch.randn(tokens, kv_heads * groups, dim, generator=gen).to(device, dtype)
    sequences = [(tables[i].tolist(), start, count) for i, (start, count) in enumerate(spans)]
    plan = triton_attention.step_tiles(sequences, groups, kv_heads, block_size, device)
    out = triton_attention.paged_attention(query, keys, values, plan, 0.25, window=window).float()
    row = 0
    for i, (start, count) in enumerate(spans):
        k = keys[tables[i].to(device)].transpose(0, 1).reshape(kv_heads, -1, dim).float()
        v = values[tables[i].to(device)].transpose(0, 1).reshape(kv_heads, -1, dim).float()
        for t in range(start, start + count):
            seen = slice(max(0, t - window + 1), t + 1)
            q = query[row].float().view(kv_heads, groups, dim)
            probs = (torch.einsum("hgd,hld->hgl", q, k[:, seen]) * 0.25).softmax(-1)
            expected = torch.einsum("hgl,hld->hgd", probs, v[:, seen]).reshape(-1, dim)
            torch.testing.assert_close(out[row], expected, rtol=tolerance, atol=tolerance)
            row += 1


def _blocks(spans: list[int], block_size: int, gen: torch.Generator) -> torch.Tensor:
    width = max(-(-s // block_size) for s in spans)
    order = torch.randperm(len(spans) * width + 1, generator=gen)
    return order[: len(spans) * width].view(len(spans), width)


@pytest.mark.parametrize("parts", [1, 2])
def test_the_decode_kernels_attend_over_the_window_only(parts: int):
    """The compiled kernel (a task a row or a kv head) and the torch path against a direct computation."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, groups, dim, block_size, window = 2, 2, 8, 4, 6
    spans = [3, 6, 7, 19, 30]
    tables = _blocks(spans, block_size, gen)
    shape = (len(spans) * tables.shape[1] + 1, kv_heads, block_size, dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(len(spans), kv_heads, groups, dim, generator=gen)
    new_k, new_v = (
        torch.randn(len(spans), kv_heads, dim, generator=gen),
        torch.randn(len(spans), kv_heads, dim, generator=gen),
    )
    args = (tables, np.array(spans), 0.3)
    torch_keys, torch_values = keys.clone(), values.clone()
    compiled = cpu_kernel.compiled_decode_attention(query, keys, values, new_k, new_v, *args, parts, window=window)
    torch_out = paged_attention.torch_decode_attention(
        query, torch_keys, torch_values, new_k, new_v, *args, window=window
    )
    for row, span in enumerate(spans):
        k = keys[tables[row]].transpose(0, 1).reshape(kv_heads, -1, dim)[:, max(0, span - window) : span]
        v = values[tables[row]].transpose(0, 1).reshape(kv_heads, -1, dim)[:, max(0, span - window) : span]
        probs = (torch.einsum("hgd,hld->hgl", query[row], k) * 0.3).softmax(-1)
        expected = torch.einsum("hgl,hld->hgd", probs, v)
        torch.testing.assert_close(compiled[row], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch_out[row], expected, rtol=1e-5, atol=1e-5)


def test_batch_invariant_serves_a_windowed_model_as_generate_does(mistral):
    prompt = _prompt(mistral, 59)
    (results, _) = asyncio.run(_serve(mistral, EngineConfig(batch_invariant=True), [prompt]))
    assert results[0][0] == _reference(mistral, prompt)  # generate's own attention, one sequence at a time


def test_gemma2_is_served_by_lmiserves_forward_alone_and_refused_at_start_without_it(tmp_path):
    """Gemma 2 runs transformers' eager attention (soft-capped logits, no SDPA), which does not go through
    the KV blocks' attention: lmiserve's forward serves it (its windows and soft cap, tests/unit/test_fast_llama.py);
    where only transformers' forward would (batch-invariant, `fast_path=false`), the engine says so at start."""
    tokenizer = build_tiny_tokenizer()
    config = Gemma2Config(
        vocab_size=len(tokenizer), **{**COMMON, "num_hidden_layers": 3, "head_dim": 16, "tie_word_embeddings": False}
    )
    torch.manual_seed(7)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_causal_lm(tmp_path, dtype="fp32", device=DEVICE)  # loads (eager attention), then:
    assert create_engine(loaded, EngineConfig()).runner.path == "fast"
    for config in (EngineConfig(batch_invariant=True), EngineConfig(fast_path=False)):
        with pytest.raises(ValueError, match="cannot be served.*attention functions"):
            create_engine(loaded, config)
