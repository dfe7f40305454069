"""The start-up CPU autotune (engine/model/autotune.py), the product shapes it chooses among
(engine/model/cpu_gemm.py) and the CPU description it is keyed by (core/cpu_info.py)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmiserve.core.cpu_info import KERNEL_FLAGS, cpu_info, parse_cpuinfo
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention import cpu_kernel
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model import autotune
from lmiserve.engine.model.cpu_gemm import BIG_OUT, NEVER, CpuGemm
from lmiserve.engine.model.fast_llama import FastLlama


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """The suite's own servers may load the machine: the tests say how busy it is."""
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (0.1, 0.1, 0.1))


CANDIDATES = {
    "plain": CpuGemm.plain(),
    "blocks": CpuGemm(splits=2),
    "transposed": CpuGemm(1, 8, 2, True),
    "blocks+transposed": CpuGemm.tuned_default(2),
    "few-row kernel": CpuGemm(few_rows=9),
    "blocks+transposed, few-row kernel to 4": CpuGemm(2, 8, 2, True, 4),
}


@pytest.mark.parametrize("name", CANDIDATES)
@pytest.mark.parametrize("out", [96, BIG_OUT + 64])
def test_every_product_shape_computes_f_linear(name: str, out: int):
    gemm = CANDIDATES[name]
    weight, bias = torch.randn(out, 64), torch.randn(out)
    for rows in (1, 2, 5, 8, 13, 32, 33):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(gemm.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemm.linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_static_default_is_the_epyc_choice_for_fp32_cpu_only():
    cpu = CpuGemm.for_model(torch.device("cpu"), torch.float32)
    assert cpu.splits >= 2 and (cpu.transpose_from, cpu.vocab_transpose_from, cpu.pad) == (8, 2, True)
    assert cpu.row_padding(13) == 3 and cpu.row_padding(4) == 0
    assert cpu.few_rows == 9 and cpu.row_padding(9) == 0 and cpu.row_padding(9, pad_from=2) == 0
    assert CpuGemm.from_dict({k: v for k, v in cpu.to_dict().items() if k != "few_rows"}).few_rows == 0  # a v1 entry
    bf16 = CpuGemm.for_model(torch.device("cpu"), torch.bfloat16)
    assert bf16 == CpuGemm.plain() and bf16.row_padding(13) == 0 and bf16.transpose_from == NEVER
    assert CpuGemm.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu


def test_cpuinfo_gives_the_model_and_the_kernel_flags():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert parse_cpuinfo(text) == (
        "Intel(R) Xeon(R) Processor",
        {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"},
    )
    here = cpu_info()
    assert here.model and here.logical_cpus >= 1 and set(here.flags) <= set(KERNEL_FLAGS)
    assert here.as_dict()["model"] == here.model


def _fast(loaded) -> FastLlama:
    """The fast forward over a pool of 4 sequences' blocks at 256 positions (the autotune's steps take any)."""
    return FastLlama(loaded.model, paged_cache(loaded.model, 4 * 256 // 16, 16), 256)


def test_small_models_keep_the_static_choice(tiny_model, tmp_path: Path):
    fast = _fast(tiny_model)
    choice = autotune.choose(fast, 4, tmp_path / "autotune.json")
    assert choice.source.startswith("static (model under") and choice.gemm == fast.gemm
    assert not (tmp_path / "autotune.json").exists()


def test_measures_once_then_reads_the_cache(tiny_model, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(autotune, "SMALL_REPEATS", 1)
    monkeypatch.setattr(autotune, "LARGE_REPEATS", 1)
    path = tmp_path / "sub" / "autotune.json"
    first = autotune.choose(_fast(tiny_model), 4, path)
    assert first.source == "measured"
    assert {"b1 blocks", "b1 plain", "b4 transposed", "b4 plain"} <= set(first.timings_ms)
    assert {"chunk 3 few-row", "chunk 3 blas"} <= set(first.timings_ms) and first.gemm.few_rows in (0, 4, 9)
    entries = json.loads(path.read_text())
    (key, entry), *_ = entries.items()
    assert cpu_info().model in key and "batch 4" in key and "float32" in key
    assert entry["cpu"]["model"] == cpu_info().model and CpuGemm.from_dict(entry["gemm"]) == first.gemm

    # a later start reads the entry (here edited by hand) instead of measuring
    entry["gemm"], entry["compiled_attention"] = CpuGemm(1, 8, 2, True).to_dict(), False
    path.write_text(json.dumps(entries))
    fast = _fast(tiny_model)
    again = autotune.choose(fast, 4, path)
    assert again.source.startswith("cache") and again.gemm == CpuGemm(1, 8, 2, True)
    assert fast.gemm == again.gemm and fast.compiled_attention is False
    assert "transposed from 8 rows" in again.describe() and "decode attention: torch" in again.describe()


def test_a_choice_without_the_compiled_attention_is_not_read_for_a_pool_it_serves(
    tiny_model, tmp_path: Path, monkeypatch
):
    """The key holds the compute and KV cache dtypes: a choice measured over an fp8 pool where the compiled
    attention cannot run (as before it read fp8 caches; so cached without it) is not the choice of the same model
    over its own-dtype pool, nor is an fp32 model's its bf16 copy's (a quantized model's weight kind is the same in
    both)."""
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(autotune, "SMALL_REPEATS", 1)
    monkeypatch.setattr(autotune, "LARGE_REPEATS", 1)
    path = tmp_path / "autotune.json"
    fp8 = FastLlama(tiny_model.model, paged_cache(tiny_model.model, 64, 16, KvFormat("fp8")), 256)
    with monkeypatch.context() as patched:
        patched.setattr(cpu_kernel, "CACHE_DTYPES", (torch.float32, torch.bfloat16))
        assert autotune.choose(fp8, 4, path).compiled_attention is False
    own = _fast(tiny_model)
    choice = autotune.choose(own, 4, path)
    assert choice.source == "measured" and own.compiled_attention == choice.compiled_attention
    keys = set(json.loads(path.read_text()))
    assert {k.split("|")[-2] for k in keys} == {"float32, kv float8_e4m3fn", "float32, kv float32"}
    bf16 = copy.deepcopy(tiny_model.model).to(torch.bfloat16)
    assert autotune.cache_key(FastLlama(bf16, paged_cache(bf16, 64, 16), 256), 4) not in keys


def test_an_unreadable_cache_is_measured_again(tiny_model, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(autotune, "SMALL_REPEATS", 1)
    monkeypatch.setattr(autotune, "LARGE_REPEATS", 1)
    path = tmp_path / "autotune.json"
    path.write_text("{not json")
    assert autotune.choose(_fast(tiny_model), 2, path).source == "measured"
    assert len(json.loads(path.read_text())) == 1


def _greedy(loaded, prompt: str, tokens: int) -> list[int]:
    ids = torch.tensor([loaded.tokenizer(prompt).input_ids])
    with torch.inference_mode():
        out = loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-attention", "torch-attention"])
@pytest.mark.parametrize("name", CANDIDATES)
def test_every_choice_gives_generates_greedy_tokens(tiny_model, tmp_path: Path, monkeypatch, name, compiled):
    """Whatever the autotune picks (here forced through its cache), greedy output stays generate's."""
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    path = tmp_path / "autotune.json"
    key = autotune.cache_key(_fast(tiny_model), 8)
    path.write_text(json.dumps({key: {"gemm": CANDIDATES[name].to_dict(), "compiled_attention": compiled}}))
    engine = create_engine(tiny_model, EngineConfig(max_running=8, cpu_autotune=True, autotune_cache=str(path)))
    assert engine.runner.kernels.gemm == CANDIDATES[name] and engine.runner.kernels.source.startswith("cache")
    prompts = ["The quick brown fox", "Hello world! How are you", "Deep learning is", "def add(a, b):"] * 3

    async def one(i: int, prompt: str) -> list[int]:
        await asyncio.sleep(0.005 * i)
        params = SamplingParams(max_new_tokens=10, ignore_eos_token=True)
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token]

    async def run() -> list[list[int]]:
        engine.start()
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.stop()

    for prompt, got in zip(prompts, asyncio.run(run())):
        assert got == _greedy(tiny_model, prompt, 10)


def test_out_of_time_keeps_the_static_choice_for_an_hour(tiny_model, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(autotune, "BUDGET_S", 0.0)
    path = tmp_path / "autotune.json"
    fast = _fast(tiny_model)
    static = fast.gemm
    choice = autotune.choose(fast, 4, path)
    assert choice.source.startswith("static (autotune over") and choice.gemm == static == fast.gemm
    (entry,) = json.loads(path.read_text()).values()
    assert entry["incomplete"] is True
    assert autotune.choose(_fast(tiny_model), 4, path).source.startswith("cache")  # not measured again
    monkeypatch.setattr(autotune, "RETRY_S", -1.0)  # an hour later
    monkeypatch.setattr(autotune, "BUDGET_S", 60.0)
    monkeypatch.setattr(autotune, "SMALL_REPEATS", 1)
    monkeypatch.setattr(autotune, "LARGE_REPEATS", 1)
    assert autotune.choose(_fast(tiny_model), 4, path).source == "measured"
    (entry,) = json.loads(path.read_text()).values()
    assert entry["incomplete"] is False


def test_timings_of_a_busy_machine_are_measured_again_after_an_hour(tiny_model, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(autotune, "SMALL_REPEATS", 1)
    monkeypatch.setattr(autotune, "LARGE_REPEATS", 1)
    path = tmp_path / "autotune.json"
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (50.0, 50.0, 50.0))
    assert autotune.machine_busy()
    assert autotune.choose(_fast(tiny_model), 4, path).source == "measured"
    (entry,) = json.loads(path.read_text()).values()
    assert entry["incomplete"] is True  # kept for RETRY_S only
    assert autotune.choose(_fast(tiny_model), 4, path).source.startswith("cache")
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(autotune, "RETRY_S", -1.0)  # an hour later, on a quiet machine
    assert autotune.choose(_fast(tiny_model), 4, path).source == "measured"
    (entry,) = json.loads(path.read_text()).values()
    assert entry["incomplete"] is False
