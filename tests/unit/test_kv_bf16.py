"""A bf16 KV cache under an fp32 model (`kv_cache_dtype=bfloat16`, vLLM's word; engine/attention/kv_quant.py): the
pool's type and size, the reads of each attention path (the torch ops, the compiled CPU kernel, Triton under its
interpreter) against attention over the same bf16 values in fp32, both runners through the compiled kernel (and over
fp8 pools too) making the torch path's tokens, the engine over the Triton kernel, preemption, SmolLM2's perplexity,
and the setting with its refusals."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from helpers.engines import greedy_ids, running_engine, text_scores
from lmiserve.config import ConfigError, Settings
from lmiserve.engine.attention import backends, cpu_kernel, kv_quant, triton_ops
from lmiserve.engine.attention import paged as paged_attention
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import PagedKVCache, kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine

BF16, FP32 = torch.bfloat16, torch.float32

PROMPTS = [
    "The capital of France is",
    "Deep learning is a subfield of",
    "Once upon a time, in a land far away,",
    "Numbers like 1, 2, 3 and",
]


def test_the_pool_stores_bf16_for_fp32_and_bf16_models_and_refuses_fp16():
    assert kv_quant.storage_dtype("bfloat16", FP32) == BF16
    assert kv_quant.storage_dtype("bfloat16", BF16) == BF16  # (the same as auto)
    with pytest.raises(ValueError, match="fp16 model"):
        kv_quant.storage_dtype("bfloat16", torch.float16)


def test_a_bf16_pool_takes_no_fp8_scales_from_the_checkpoint(tmp_path):
    from safetensors.torch import save_file

    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
    }
    save_file(scales, str(tmp_path / "model.safetensors"))
    assert KvFormat.of("fp8", tmp_path, 1).scales == ((0.5, 2.0),)  # (the checkpoint's, where it has them)
    assert KvFormat.of("bfloat16", tmp_path, 1) == KvFormat("bfloat16")


# ---- the reads, position by position against fp32 attention over the stored bf16 values ---------------------


def _pool(blocks=12, block_size=4, kv_heads=2, dim=16) -> PagedKVCache:
    return PagedKVCache(1, blocks, block_size, kv_heads, dim, FP32, "cpu", kv_dtype=BF16)


def _reference(query, keys, values, scale):
    """fp64 attention of one row's `query` ``[kv_heads, groups, dim]`` over its ``[kv_heads, L, dim]``."""
    probs = (torch.einsum("hgd,hld->hgl", query.double(), keys.double()) * scale).softmax(-1)
    return torch.einsum("hgl,hld->hgd", probs, values.double())


@pytest.mark.parametrize("path", ["torch", "compiled"])
def test_decode_over_a_bf16_pool_widens_its_values_and_sums_in_fp32(path):
    """Two decode rows of fp32 queries over a bf16 pool: the new keys and values are stored rounded to bf16, the
    output is fp32 and is attention over the stored values to fp32's rounding, not bf16's."""
    if path == "compiled" and not cpu_kernel.available(BF16, torch.device("cpu")):
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(0)
    cache = _pool()
    for layer in (cache.keys[0], cache.values[0]):
        layer.copy_(torch.randn(layer.shape, generator=gen).to(BF16))
    spans = [7, 10]
    tables = torch.tensor([[5, 2, 0], [1, 9, 4]])
    query = torch.randn(2, 2, 2, 16, generator=gen)  # [rows, kv_heads, groups, dim]
    new_keys, new_values = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    scale = 16**-0.5
    args = (query, cache.keys[0], cache.values[0], new_keys, new_values, tables, spans, scale)
    if path == "torch":
        out = paged_attention.torch_decode_attention(*args)
    else:
        out = cpu_kernel.compiled_decode_attention(*args)
    assert out.dtype == FP32
    expected = []
    for row, span in enumerate(spans):
        keys, values = paged_attention.gather_context(cache.keys[0], cache.values[0], tables[row], span, FP32)
        assert torch.equal(keys[:, -1], new_keys[row].to(BF16).float())  # stored rounded to bf16
        expected.append(_reference(query[row], keys, values, scale))
    error = float((out.double() - torch.stack(expected)).abs().max())
    assert error < 1e-5, error  # (one bf16 rounding of the output would be ~4e-3)


@pytest.mark.skipif(
    not triton_ops.available(torch.device("cpu")) and not triton_ops.interpreting(),
    reason="the Triton kernel runs on CUDA, or on a CPU under its interpreter",
)
def test_the_triton_kernel_reads_a_bf16_pool_under_fp32_queries():
    """The kernel's own start-up check over a bf16 cache (a decode row, a chunk after a prefix, a prompt; against
    fp32 attention over the stored values): it agrees to fp32's tolerance, so `choose` keeps it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton_ops.self_check.cache_clear()
    try:
        assert triton_ops.self_check(2, 2, 16, 4, FP32, device, BF16) is None
    finally:
        triton_ops.self_check.cache_clear()


# ---- the engine -------------------------------------------------------------------------------------------------


def test_the_same_memory_holds_twice_the_fp32_blocks(tiny_model, caplog):
    per_block = kv_bytes_per_block(tiny_model.model, 16)
    assert per_block == 2 * kv_bytes_per_block(tiny_model.model, 16, "bfloat16")
    budget = per_block * 10
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmiserve.engine.factory"):
        engine = create_engine(tiny_model, EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype="bfloat16"))
    if tiny_model.device.type != "cpu":
        pytest.skip("the block count below is a CPU pool's (no decode graphs' padding block)")
    assert engine.runner.num_blocks == 20 and engine.runner.kv_bytes <= budget
    assert f"KV cache: 20 blocks of 16 tokens ({budget / 2**20:.1f} MiB, torch.bfloat16)" in caplog.text


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("runner", [{"fast_path": True}, {"fast_path": False}], ids=["fast", "generic"])
async def test_both_runners_take_the_compiled_kernel_and_make_the_torch_paths_tokens(
    tiny_model, runner, kv, monkeypatch
):
    """An fp32 model over a bf16 (or fp8) pool on a CPU: lmiserve's forward and transformers' (after its start-up
    probe) run the compiled attention, and continuous batching with prompts in chunks makes the tokens of torch's ops
    over the same pool (lmiserve's torch backend; transformers' attention over the gathered blocks), which sum the
    same stored values in fp32."""
    if tiny_model.device.type != "cpu" or not cpu_kernel.available(BF16, tiny_model.device):
        pytest.skip("the compiled attention is a CPU's, with numba")
    config = {"kv_cache_dtype": kv, "max_prefill_tokens": 6, **runner}
    with monkeypatch.context() as patched:  # the reference: no compiled attention for a bf16 pool
        patched.setattr(cpu_kernel, "CACHE_DTYPES", (torch.float32,))
        async with running_engine(tiny_model, **config) as engine:
            assert engine.runner.kv.keys[0].dtype == kv_quant.storage_dtype(kv, FP32) and engine.runner.kv.dtype == FP32
            if runner["fast_path"]:
                assert type(engine.runner.fast.attention) is backends.TorchBackend
            else:
                assert engine.runner.attention is None  # (transformers' attention over the gathered blocks)
            gathered = await asyncio.gather(*(greedy_ids(engine, p) for p in PROMPTS))
    async with running_engine(tiny_model, **config) as engine:
        attention = engine.runner.fast.attention if runner["fast_path"] else engine.runner.attention
        assert isinstance(attention, backends.CpuKernelBackend)
        compiled = await asyncio.gather(*(greedy_ids(engine, p) for p in PROMPTS))
    assert compiled == gathered
    assert all(len(ids) == 16 for ids in compiled)


async def test_preemption_over_a_small_bf16_pool_finishes_every_request(tiny_model):
    """24 blocks of 4 tokens under 8 concurrent requests of ~30 tokens: requests are preempted and recomputed, and
    (a recompute writes the same bf16 values) each makes the tokens of a pool that never preempts."""
    prompts = [p + " and then" for p in PROMPTS] * 2
    plain = {"kv_cache_dtype": "bfloat16", "block_size": 4, "enable_prefix_caching": False}
    async with running_engine(tiny_model, **plain) as engine:
        roomy = await asyncio.gather(*(greedy_ids(engine, p, 24) for p in prompts))
    budget = kv_bytes_per_block(tiny_model.model, 4, "bfloat16") * 24
    async with running_engine(tiny_model, kv_cache_memory_bytes=budget, **plain) as engine:
        tight = await asyncio.gather(*(greedy_ids(engine, p, 24) for p in prompts))
        assert engine.snapshot().preemptions > 0
    assert tight == roomy


async def test_smollm2_over_a_bf16_pool_keeps_its_perplexity_and_next_token_choices(smollm_model):
    """The bundled SmolLM2-135M in fp32 on 400 tokens of Austen, prefilled in chunks of 128 (each chunk reads the
    earlier ones from the pool): a bf16 pool keeps the perplexity to 0.5 % and the most likely next token at >= 97 %
    of positions (measured on the whole text: benchmarks/results/issue39-kv-bf16-2026-12-07)."""
    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "texts" / "pride_and_prejudice_ch1.txt").read_text()
    ids = smollm_model.tokenizer(text)["input_ids"][:400]
    scores = {}
    for name in ("auto", "bfloat16"):
        async with running_engine(smollm_model, kv_cache_dtype=name, max_prefill_tokens=128) as engine:
            scores[name] = await text_scores(engine, ids)
    (auto_ppl, auto_top), (ppl, top) = scores["auto"], scores["bfloat16"]
    same = sum(a == b for a, b in zip(auto_top, top, strict=True)) / len(auto_top)
    assert abs(ppl / auto_ppl - 1) < 0.005 and same >= 0.97, (ppl, auto_ppl, same)


# ---- the setting ----------------------------------------------------------------------------------------------


def test_the_setting_takes_vllms_word_and_bf16_and_refuses_an_fp16_model():
    assert Settings.from_options({"option.kv_cache_dtype": "BFloat16"}).kv_cache_dtype == "bfloat16"
    assert Settings.from_options({"kv_cache_dtype": "bf16"}).kv_cache_dtype == "bfloat16"  # (as `dtype` takes it)
    assert Settings.from_options({"kv_cache_dtype": "bf16", "dtype": "bf16"}).kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="kv_cache_dtype=bfloat16 under dtype=fp16"):
        Settings.from_options({"kv_cache_dtype": "bfloat16", "dtype": "float16"})
    from lmiserve.models.compose import engine_config

    assert engine_config(Settings.from_options({"kv_cache_dtype": "bf16"})).kv_cache_dtype == "bfloat16"


def test_an_fp16_model_found_at_load_is_refused_at_the_engines_start(tiny_model_dir):
    """`dtype=auto` may resolve to fp16 (a checkpoint's own type on a GPU): the engine's start refuses it."""
    from lmiserve.models.load import load_causal_lm

    fp16 = load_causal_lm(tiny_model_dir, dtype="fp16", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16 would round an fp16 model"):
        create_engine(fp16, EngineConfig(kv_cache_dtype="bfloat16"))


@pytest.mark.skipif(
    not triton_ops.available(torch.device("cpu")) and not triton_ops.interpreting(),
    reason="the Triton kernel runs on CUDA, or on a CPU under its interpreter",
)
@pytest.mark.parametrize("fused", [False, True], ids=["fast", "fast-fused"])
async def test_the_engine_over_the_triton_kernel_reads_a_bf16_pool_as_the_torch_path_does(
    tiny_model, monkeypatch, fused
):
    """Continuous batching with prompts in chunks, every step's attention in the Triton kernel over a bf16 pool under
    the fp32 model (its writes cast by `write_step`, or with the fused kernels by `fused_norm.rope_store` with the
    rotation; its loads cast to fp32 in the kernel): the greedy tokens of the CPU's path over the same pool
    (``LMISERVE_ATTENTION_BACKEND=torch``: on a CPU, the compiled kernel)."""
    from lmiserve.engine.model import fused_norm

    stored: list[int] = []
    if fused:  # (forced: not measured)
        monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
        monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)
        store = fused_norm.rope_store
        monkeypatch.setattr(fused_norm, "rope_store", lambda *a: stored.append(1) or store(*a))
    config = {"kv_cache_dtype": "bfloat16", "max_prefill_tokens": 6, "fast_path": True}
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "torch")
    async with running_engine(tiny_model, **config) as engine:
        gathered = await asyncio.gather(*(greedy_ids(engine, p, 8) for p in PROMPTS))
    stored.clear()
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    triton_ops.self_check.cache_clear()
    try:
        async with running_engine(tiny_model, **config) as engine:
            assert isinstance(engine.runner.fast.attention, backends.TritonBackend)
            kernel = await asyncio.gather(*(greedy_ids(engine, p, 8) for p in PROMPTS))
    finally:
        triton_ops.self_check.cache_clear()
    assert kernel == gathered
    assert bool(stored) == fused
