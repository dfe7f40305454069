"""The fp8 KV cache (`kv_cache_dtype`, engine/attention/kv_quant.py): quantize/dequantize, the paged pool's
reads and writes in fp8 (torch path, prefill context, Triton under its interpreter), the backend choice on
CPU, the pool's size for a memory bound, the engine's greedy output against `auto`, the prefix cache and
preemption over an fp8 pool, and the setting. Quality on SmolLM2: benchmarks/kv_fp8_quality.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.engines import greedy_ids, running_engine, text_scores
from lmiserve.config import ConfigError, Settings, load_settings
from lmiserve.engine import fp8_devices
from lmiserve.engine.attention import backends, cuda_graphs, kv_quant, triton_ops
from lmiserve.engine.attention import paged as paged_attention
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import PagedKVCache, kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model import fused_norm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- quantize / dequantize -------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "mantissa"), [(E4M3, 3), (E5M2, 2)])
@pytest.mark.parametrize("scale", [1.0, 0.25, 8.0])
def test_a_round_trip_is_within_half_a_unit_of_the_last_place(dtype, mantissa, scale):
    """Values in the type's normal range come back within 2^-(mantissa+1) relative (round to nearest)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 10 * scale
    x = x[(x / scale).abs() > 0.1]  # normal numbers of both types
    back = kv_quant.dequantize(kv_quant.quantize(x, dtype, scale), torch.float32, scale)
    relative = ((back - x).abs() / x.abs()).max().item()
    assert relative <= 2.0 ** -(mantissa + 1) + 1e-6
    assert kv_quant.quantize(x, dtype, scale).dtype == dtype


@pytest.mark.parametrize(("dtype", "largest"), [(E4M3, 448.0), (E5M2, 57344.0)])
def test_writes_saturate_at_the_largest_finite_value_never_inf(dtype, largest):
    x = torch.tensor([1e9, -1e9, largest * 3, float("inf"), -float("inf"), 1.0])
    for scale in (1.0, 2.0):
        back = kv_quant.dequantize(kv_quant.quantize(x, dtype, scale), torch.float32, scale)
        assert back.tolist() == [largest * scale, -largest * scale] + [largest * scale] * 2 + [-largest * scale, 1.0]
    # bf16 input, fp32 compute: the same numbers
    bf16 = kv_quant.quantize(x.bfloat16(), dtype, 1.0)
    assert kv_quant.dequantize(bf16, torch.bfloat16).float()[:2].tolist() == [largest, -largest]


def test_the_names_are_vllms_and_auto_is_the_models_dtype():
    assert kv_quant.storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.storage_dtype("fp8", torch.float32) == E4M3
    assert kv_quant.storage_dtype("fp8_e4m3", torch.float16) == E4M3
    assert kv_quant.storage_dtype("fp8_e5m2", torch.float16) == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        kv_quant.storage_dtype("int8", torch.float32)
    # a plain dtype: quantize and dequantize are casts, the scale unused
    x = torch.randn(5)
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(x, torch.float32, 3.0), torch.float32, 3.0), x)


def test_checkpoint_scales_are_read_where_the_checkpoint_has_them(tmp_path):
    """vLLM's `k_scale`/`v_scale` per attention layer (or one `kv_scale`); none, or not every layer: 1.0."""
    from safetensors.torch import save_file

    assert kv_quant.checkpoint_scales(str(tmp_path / "none"), 2) == ()  # no checkpoint at all
    tensors = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
    }
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor([3.0])
    tensors["model.embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert kv_quant.checkpoint_scales(str(tmp_path), 2) == ((0.5, 2.0), (3.0, 3.0))
    assert KvFormat.of("fp8", tmp_path, 2).layer_scales(2) == [(0.5, 2.0), (3.0, 3.0)]
    assert KvFormat.of("auto", tmp_path, 2).layer_scales(2) == [(1.0, 1.0)] * 2  # auto reads nothing
    assert kv_quant.checkpoint_scales(str(tmp_path), 3) == ()  # layer 2 has none: 1.0 everywhere


# ---- the pool's reads and writes ----------------------------------------------------------------------------


def _pool(dtype, kv_dtype, scales=None, blocks=12, block_size=4, kv_heads=2, dim=16):
    cache = PagedKVCache(1, blocks, block_size, kv_heads, dim, dtype, kv_dtype=kv_dtype, scales=scales)
    cache.ensure_zeroed(blocks)
    return cache


def test_an_fp8_pool_stores_one_byte_an_element_and_copies_blocks():
    fp32 = _pool(torch.float32, None)
    fp8 = _pool(torch.float32, E4M3)
    assert fp8.keys[0].dtype == E4M3 and fp8.dtype == torch.float32 and fp8.quantized and not fp32.quantized
    assert fp32.nbytes == 4 * fp8.nbytes
    gen = torch.Generator().manual_seed(1)
    paged_attention.write_chunk(
        fp8.keys[0], fp8.values[0], torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen),
        torch.tensor([3]), 0,
    )  # fmt: skip
    fp8.copy_blocks([(3, 7)])
    assert torch.equal(fp8.keys[0][7].view(torch.uint8), fp8.keys[0][3].view(torch.uint8))
    with pytest.raises(ValueError, match="2 KV scales for 1 layers"):
        PagedKVCache(1, 2, 4, 2, 16, torch.float32, kv_dtype=E4M3, scales=[(1.0, 1.0)] * 2)


# the torch ops, and the compiled CPU kernel with a task a kv head and with whole rows a task
DECODE_PATHS = {
    "torch": paged_attention.torch_decode_attention,
    "compiled-heads": functools.partial(backends.cpu_kernel.compiled_decode_attention, parts=2),
    "compiled-rows": functools.partial(backends.cpu_kernel.compiled_decode_attention, parts=1),
}


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_an_fp8_pool_is_attention_over_its_dequantized_values(kv_dtype, dtype, path):
    """Each path writes each row's new key and value quantized (with the layer's scales) and attends over the
    dequantized blocks: the same as fp32 attention over the dequantized cache."""
    if path != "torch" and not backends.cpu_kernel.available(kv_dtype, torch.device("cpu")):
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(2)
    scales = (0.5, 2.0)
    cache = _pool(dtype, kv_dtype, [scales])
    spans = np.array([5, 11, 1])
    tables = torch.tensor([[4, 9, 0], [1, 2, 8], [6, 0, 0]])
    ctx_k, ctx_v = torch.randn(12, 2, 4, 16, generator=gen), torch.randn(12, 2, 4, 16, generator=gen)
    cache.keys[0].copy_(kv_quant.quantize(ctx_k, kv_dtype, scales[0]))
    cache.values[0].copy_(kv_quant.quantize(ctx_v, kv_dtype, scales[1]))
    query = torch.randn(3, 2, 2, 16, generator=gen).to(dtype)
    new_k, new_v = torch.randn(3, 2, 16, generator=gen).to(dtype), torch.randn(3, 2, 16, generator=gen).to(dtype)
    out = DECODE_PATHS[path](query, cache.keys[0], cache.values[0], new_k, new_v, tables, spans, 0.25, scales=scales)
    assert out.dtype == dtype
    keys = kv_quant.dequantize(cache.keys[0], torch.float32, scales[0])  # with the rows' new tokens written
    values = kv_quant.dequantize(cache.values[0], torch.float32, scales[1])
    for row, span in enumerate(spans.tolist()):
        last = span - 1
        block, offset = int(tables[row, last // 4]), last % 4
        written = kv_quant.quantize(new_k[row].float(), kv_dtype, scales[0])
        assert torch.equal(cache.keys[0][block, :, offset].view(torch.uint8), written.view(torch.uint8))
        k = torch.cat([keys[int(b)] for b in tables[row]], dim=1)[:, :span]  # [kv_heads, span, dim]
        v = torch.cat([values[int(b)] for b in tables[row]], dim=1)[:, :span]
        probs = (torch.einsum("hgd,hsd->hgs", query[row].float(), k) * 0.25).softmax(-1)
        expected = torch.einsum("hgs,hsd->hgd", probs, v)
        tolerance = 1e-5 if dtype == torch.float32 else 5e-2
        assert (out[row].float() - expected).abs().max().item() < tolerance


def test_prefill_context_is_dequantized_in_the_compute_dtype():
    cache = _pool(torch.float32, E5M2, [(4.0, 0.25)])
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    table = torch.tensor([5, 2])
    paged_attention.write_chunk(cache.keys[0], cache.values[0], k, v, table, 0, (4.0, 0.25))
    with pytest.raises(ValueError, match="pass dtype"):
        paged_attention.gather_context(cache.keys[0], cache.values[0], table, 6)
    keys, values = paged_attention.gather_context(cache.keys[0], cache.values[0], table, 6, torch.float32, (4.0, 0.25))
    assert keys.dtype == torch.float32 and keys.shape == (2, 6, 16)
    assert torch.equal(keys, kv_quant.dequantize(kv_quant.quantize(k, E5M2, 4.0), torch.float32, 4.0).transpose(0, 1))
    assert (values - v.transpose(0, 1)).abs().max() <= 0.125 * v.abs().max()


def test_on_cpu_an_fp8_pool_runs_the_compiled_kernel():
    """The compiled CPU kernel reads fp8 pools (each byte through its format's table of values): an fp32 or bf16
    model over an fp8 pool takes it, as over a pool of its own dtype."""
    if not backends.cpu_kernel.available(E4M3, torch.device("cpu")):
        pytest.skip("numba is not installed")
    for dtype in (torch.float32, torch.bfloat16):
        for kv_dtype in (E4M3, E5M2):
            assert type(backends.choose(_pool(dtype, kv_dtype), 4, [None])) is backends.CpuKernelBackend
    with pytest.raises(ValueError, match="reads fp32, bf16 and fp8 CPU caches"):
        backends.CpuKernelBackend(_pool(torch.float16, None), 4, [None])


# the Triton kernel: on a CPU under its interpreter (the test suite sets TRITON_INTERPRET=1), compiled on the
# GPU where LMISERVE_TEST_DEVICE=cuda (benchmarks/gpu_check.py runs this file there)
DEVICE = os.environ.get("LMISERVE_TEST_DEVICE", "cpu")
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.skipif(
    not triton_ops.available(torch.device(DEVICE)) and not (DEVICE == "cpu" and triton_ops.interpreting()),
    reason="the Triton kernel runs on CUDA, or on a CPU under its interpreter",
)
@pytest.mark.parametrize("widened", [False, True], ids=["fp8-types", "widened"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_triton_kernel_reads_fp8_blocks(kv_dtype, dtype, widened, monkeypatch):
    """The kernel's fp8 form (load, cast, key scale on the scores, value scale on the output) against
    attention position by position over the dequantized cache: `self_check`, which a GPU runs before
    taking the kernel. `widened`: as on a GPU without fp8 conversions (an A100 or A10G), the bytes widened by
    the kernel itself. (bf16 does not run under the interpreter, fp8 or not: it is checked on the GPU.)"""
    if widened:
        monkeypatch.setattr(fp8_devices, "native", lambda device: False)
    triton_ops.self_check.cache_clear()
    assert triton_ops.self_check(3, 3, 64, 16, dtype, DEVICE, kv_dtype) is None
    assert triton_ops.self_check(2, 2, 32, 8, dtype, DEVICE, kv_dtype) is None
    triton_ops.self_check.cache_clear()  # (not kept for the other form)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_widened_fp8_bytes_are_every_fp8_value_exactly(kv_dtype, monkeypatch):
    """Every byte of the type but NaN (and e5m2's infinities) as one key position's values, read back by the
    kernel's widening (as an A100 reads an fp8 pool): one query on a one-hot key makes the output the value row
    itself, so each value must come back exact, fp32 throughout."""
    if DEVICE != "cpu" or not triton_ops.interpreting():
        pytest.skip("under Triton's interpreter")
    monkeypatch.setattr(fp8_devices, "native", lambda device: False)
    every = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    finite = every[torch.isfinite(every)]
    dims = 32
    rows = finite.reshape(-1, dims) if finite.numel() % dims == 0 else torch.cat(
        [finite, torch.zeros(dims - finite.numel() % dims)]
    ).reshape(-1, dims)  # fmt: skip
    block_size = 16
    positions = rows.shape[0]
    blocks = -(-positions // block_size) + 1
    keys = torch.zeros(blocks, 1, block_size, dims)
    values = torch.zeros(blocks, 1, block_size, dims)
    for p in range(positions):
        values[p // block_size, 0, p % block_size] = rows[p]
    got = []
    for p in range(positions):  # one query a position: attention on position p alone (the others masked by -inf)
        keys_p = torch.zeros_like(keys)
        keys_p[p // block_size, 0, p % block_size, 0] = 1.0
        plan = triton_ops.step_tiles([(list(range(blocks)), p, 1)], 1, 1, block_size, torch.device("cpu"))
        query = torch.zeros(1, 1, dims)
        query[0, 0, 0] = 1e4  # softmax puts all weight on position p
        out = triton_ops.paged_attention(
            query, keys_p.to(kv_dtype), values.to(kv_dtype), plan, 1.0, kv_scales=(1.0, 1.0)
        )
        got.append(out[0, 0])
    assert torch.equal(torch.stack(got), rows)


def test_the_kernels_e4m3_bytes_are_torchs_cast():
    """`fp8_w8a8_kernel.e4m3_bytes` (the bytes an e4m3 cache stores from the rotation's kernel, made with integer ops
    on any GPU): torch's ``.to(float8_e4m3fn)`` of the clamped value, byte for byte, at every finite e4m3 value,
    each midpoint between neighbours (ties to even), just off each, the subnormals and zeros of both signs, past
    448, and random values over the whole range (compiled on a GPU: the GPU check's engine tests)."""
    if DEVICE != "cuda" and not triton_ops.interpreting():
        pytest.skip("on CUDA, or under Triton's interpreter")
    import triton

    from helpers.e4m3_kernel import e4m3_bytes_kernel

    every = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = every[torch.isfinite(every)].unique()  # (sorted; -0 and 0 as one)
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat(
        [grid, mid, mid * (1 + 1e-6), mid * (1 - 1e-6), torch.tensor([-0.0, 0.0, 500.0, -1e9, 1e-30, -1e-30])]
    )
    x = torch.cat([x, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 30, torch.rand(512) * 0.02])
    got = torch.empty(x.numel(), dtype=torch.uint8, device=DEVICE)
    triton.jit(e4m3_bytes_kernel)[(triton.cdiv(x.numel(), 256),)](x.to(DEVICE), got, x.numel(), BLOCK=256)
    got, want = got.cpu(), x.clamp(-448, 448).to(E4M3).view(torch.uint8)
    assert torch.equal(got, want), (x[got != want][:8], got[got != want][:8], want[got != want][:8])


# ---- the engine ---------------------------------------------------------------------------------------------


PROMPTS = [
    "The capital of France is",
    "Deep learning is a subfield of",
    "Once upon a time, in a land far away,",
    "Numbers like 1, 2, 3 and",
]


def test_the_same_memory_holds_four_times_the_fp32_blocks_and_twice_the_bf16(tiny_model, tiny_model_dir, caplog):
    """The pool's budget over a block's bytes, one byte an element: an fp32 model's pool holds 4x the
    blocks in fp8, a bf16 model's 2x; the start-up line says the pool's element type."""
    from lmiserve.models.load import load_causal_lm

    bf16_model = load_causal_lm(tiny_model_dir, dtype="bf16", device="cpu")
    for loaded, ratio in ((tiny_model, 4), (bf16_model, 2)):
        per_block = kv_bytes_per_block(loaded.model, 16)
        assert per_block == ratio * kv_bytes_per_block(loaded.model, 16, "fp8")
        assert kv_bytes_per_block(loaded.model, 16, "fp8_e5m2") == kv_bytes_per_block(loaded.model, 16, "fp8")
        budget = per_block * 10
        scratch = int(cuda_graphs.wanted(loaded.device, False))  # the decode graphs' padding block (CUDA)
        counts = {}
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmiserve.engine.factory"):
            for name in ("auto", "fp8"):
                engine = create_engine(loaded, EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype=name))
                counts[name] = engine.runner.num_blocks
                assert engine.runner.kv_bytes <= budget
        assert counts == {"auto": 10 - scratch, "fp8": 10 * ratio - scratch}
        mib = (budget - scratch * per_block / ratio) / 2**20
        line = f"KV cache: {10 * ratio - scratch} blocks of 16 tokens ({mib:.1f} MiB, torch.float8_e4m3fn)"
        assert line in caplog.text
        mib = (budget - scratch * per_block) / 2**20
        assert f"({mib:.1f} MiB, {loaded.model.dtype})" in caplog.text  # auto: the model's dtype


@pytest.mark.parametrize("runner", [{"fast_path": True}, {"fast_path": False}], ids=["fast", "generic"])
async def test_both_runners_serve_over_an_fp8_pool_deterministically(tiny_model, runner):
    """lmiserve's forward and transformers' over an fp8 pool: every request makes its tokens, the same ones
    twice. (The tiny random model's near-uniform logits say nothing of quality: SmolLM2's test below.)"""
    for name in ("fp8", "fp8_e5m2"):
        async with running_engine(tiny_model, kv_cache_dtype=name, **runner) as engine:
            assert engine.runner.kv.quantized and engine.runner.kv.keys[0].dtype == kv_quant.storage_dtype(name, E4M3)
            first = [await greedy_ids(engine, p) for p in PROMPTS]
            assert first == [await greedy_ids(engine, p) for p in PROMPTS]
            assert all(len(ids) == 16 for ids in first)


async def test_smollm2_over_an_fp8_pool_keeps_its_perplexity_and_next_token_choices(smollm_model):
    """The bundled SmolLM2-135M on 400 tokens of Austen, prefilled in chunks of 128 (each chunk reads the
    earlier ones from the pool): fp8 costs at most a few percent of perplexity and keeps the most likely
    next token at >= 85 % of positions (measured: e4m3 +1.0 %, 94.9 %; e5m2 +2.1 %, 90.9 % on the whole
    text, benchmarks/results/issue39-fp8kv-2026-11-29)."""
    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "texts" / "pride_and_prejudice_ch1.txt").read_text()
    ids = smollm_model.tokenizer(text)["input_ids"][:400]
    scores = {}
    for name in ("auto", "fp8_e4m3", "fp8_e5m2"):
        async with running_engine(smollm_model, kv_cache_dtype=name, max_prefill_tokens=128) as engine:
            scores[name] = await text_scores(engine, ids)
    auto_ppl, auto_top = scores["auto"]
    for name in ("fp8_e4m3", "fp8_e5m2"):
        ppl, top = scores[name]
        same = sum(a == b for a, b in zip(auto_top, top, strict=True)) / len(auto_top)
        assert ppl / auto_ppl < 1.05 and same >= 0.85, (name, ppl, auto_ppl, same)


@pytest.mark.skipif(
    not triton_ops.available(torch.device(DEVICE)) and not (DEVICE == "cpu" and triton_ops.interpreting()),
    reason="the Triton kernel runs on CUDA, or on a CPU under its interpreter",
)
@pytest.mark.parametrize(
    ("runner", "widened"),
    [
        ({"fast_path": True}, False),
        ({"fast_path": False}, False),
        ({"fast_path": True}, True),
        ("fused", False),
        ("fused", True),
    ],
    ids=["fast", "generic", "fast-widened", "fast-fused", "fast-fused-widened"],
)
async def test_the_engine_over_the_triton_kernel_reads_an_fp8_pool_as_the_torch_path_does(
    tiny_model, monkeypatch, runner, widened
):
    """Continuous batching with prompts in chunks, every step's attention in the kernel over an fp8 pool
    (its writes quantized by `write_step`, or with the fused kernels by `fused_norm.rope_store` with the rotation,
    on any GPU; its reads cast in the kernel, or `widened` by it as on an A100): the torch backend's greedy tokens
    over the same kind of pool."""
    if widened:
        monkeypatch.setattr(fp8_devices, "native", lambda device: False)
        triton_ops.self_check.cache_clear()  # (the backend's start-up check runs the widened form)
    stored: list[int] = []
    fused = runner == "fused"
    if fused:  # (forced: not measured)
        monkeypatch.setattr(fused_norm, "wanted", lambda device: True)
        monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)
        store = fused_norm.rope_store
        monkeypatch.setattr(fused_norm, "rope_store", lambda *a: stored.append(1) or store(*a))
        runner = {"fast_path": True}
    config = {"kv_cache_dtype": "fp8", "max_prefill_tokens": 6, **runner}
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "torch")
    async with running_engine(tiny_model, **config) as engine:
        gathered = await asyncio.gather(*(greedy_ids(engine, p, 8) for p in PROMPTS))
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    async with running_engine(tiny_model, **config) as engine:
        attention = engine.runner.fast.attention if runner["fast_path"] else engine.runner.attention
        assert isinstance(attention, backends.TritonBackend)
        kernel = await asyncio.gather(*(greedy_ids(engine, p, 8) for p in PROMPTS))
    triton_ops.self_check.cache_clear()
    assert kernel == gathered
    assert bool(stored) == fused  # (the torch backend's engine writes its own)


async def test_the_prefix_cache_over_an_fp8_pool_gives_a_fresh_engines_tokens(tiny_model):
    """Blocks shared from an earlier prompt hold the same fp8 bytes a fresh prefill writes."""
    system = "The server streams tokens to the client as soon as they are generated. " * 2
    prompts = [system + p for p in PROMPTS] * 2
    async with running_engine(tiny_model, kv_cache_dtype="fp8", enable_prefix_caching=False, block_size=4) as engine:
        plain = [await greedy_ids(engine, p) for p in prompts]
    async with running_engine(tiny_model, kv_cache_dtype="fp8", block_size=4) as engine:
        cached = [await greedy_ids(engine, p) for p in prompts]
        assert engine.snapshot().prefix_cache_tokens > 0
    assert cached == plain


async def test_preemption_over_a_small_fp8_pool_finishes_every_request(tiny_model):
    """A pool of 24 blocks of 4 tokens under 8 concurrent requests of ~30 tokens each: requests are preempted
    and recomputed; each still makes its tokens, and (recompute writes the same fp8 bytes) those of a pool
    that never preempts."""
    prompts = [p + " and then" for p in PROMPTS] * 2
    per_block = kv_bytes_per_block(tiny_model.model, 4, "fp8")
    async with running_engine(tiny_model, kv_cache_dtype="fp8", block_size=4, enable_prefix_caching=False) as engine:
        roomy = await asyncio.gather(*(greedy_ids(engine, p, 24) for p in prompts))
    small = {"kv_cache_memory_bytes": per_block * 24, "block_size": 4, "enable_prefix_caching": False}
    async with running_engine(tiny_model, kv_cache_dtype="fp8", **small) as engine:
        # less the decode graphs' padding block on CUDA (their pool's one more block, inside the budget)
        assert engine.runner.num_blocks == 24 - int(cuda_graphs.wanted(tiny_model.device, False))
        tight = await asyncio.gather(*(greedy_ids(engine, p, 24) for p in prompts))
        preempted = engine.snapshot().preemptions
    assert all(len(ids) == 24 for ids in tight)
    assert preempted > 0
    assert tight == roomy


# ---- the setting ----------------------------------------------------------------------------------------------


def test_the_setting_takes_vllms_words_in_every_spelling():
    assert Settings.from_options({}).kv_cache_dtype == "auto"
    assert Settings.from_options({"option.kv_cache_dtype": "FP8"}).kv_cache_dtype == "fp8"
    assert Settings.from_options({"kv_cache_dtype": "fp8_e5m2"}).kv_cache_dtype == "fp8_e5m2"
    settings = load_settings({}, None, None, environ={"OPTION_KV_CACHE_DTYPE": "fp8_e4m3"})
    assert (settings.kv_cache_dtype, settings.sources["kv_cache_dtype"]) == (
        "fp8_e4m3",
        "environment OPTION_KV_CACHE_DTYPE",
    )
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        Settings.from_options({"kv_cache_dtype": "int8"})
    # (over tensor parallelism each rank's pool stores it: tests/integration/test_tensor_parallel_engine.py)
    assert Settings.from_options({"kv_cache_dtype": "fp8", "tensor_parallel_degree": "2"}).kv_cache_dtype == "fp8"
    from lmiserve.models.compose import engine_config

    assert engine_config(Settings.from_options({"kv_cache_dtype": "fp8_e5m2"})).kv_cache_dtype == "fp8_e5m2"
    assert engine_config(Settings.from_options({})).kv_cache_dtype == "auto"
