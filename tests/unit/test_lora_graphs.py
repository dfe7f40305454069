"""Decode steps with LoRA adapters through the CUDA graphs (engine/lora/slots.py, engine/attention/cuda_graphs.py).

The adapters' fixed slots: their products equal `LoraBatch`'s for rows of several adapters, of the base
model and of padding, also after an adapter of a lower rank takes the slot of one of a higher rank (the
rest of the slot zeroed); a slot goes to the least recently used adapter the step does not use; their
bytes are those the pool plan reserves. The engine: decode steps of rows with adapters replay the graphs
(captured on CUDA; on a CPU the same fixed buffers run without capturing, as in test_cuda_graphs.py) and
give the tokens of `generate()` with each adapter merged by PEFT, with more adapters than slots in turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from helpers.decode_graphs import graphs_on_the_test_device  # noqa: E402
from helpers.lora_adapters import SPECS, merged_generate  # noqa: E402
from lmiserve.core.request import GenerationRequest, SamplingParams  # noqa: E402
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs  # noqa: E402
from lmiserve.engine.attention.paged import PagedKVCache  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.factory import create_engine  # noqa: E402
from lmiserve.engine.lora.adapters import LoraAdapter, read_adapter  # noqa: E402
from lmiserve.engine.lora.batch import LoraBatch, StackCache  # noqa: E402
from lmiserve.engine.lora.registry import LoraLimits  # noqa: E402
from lmiserve.engine.lora.slots import LoraSlots, slot_bytes  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama  # noqa: E402
from lmiserve.engine.pool_plan import activation_reserve  # noqa: E402

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
PROMPTS = ["Hello there, how are", "def add(a, b):", "The quick brown fox jumps"]
TOKENS = 10
NAMES = [None, *(spec.name for spec in SPECS)]


@pytest.fixture(scope="module")
def adapters(tiny_model, lora_adapter_dirs) -> dict[str, LoraAdapter]:
    """alpha (rank 8, q/v), beta (rank 4, every linear), gamma (rank 16, o/gate/down/k) on the tiny model."""
    return {
        name: read_adapter(path, tiny_model.model, name=name, max_rank=16) for name, path in lora_adapter_dirs.items()
    }


@pytest.fixture(scope="module")
def fast(tiny_model) -> FastLlama:
    cfg = tiny_model.model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, 16, tiny_model.model.dtype, DEVICE)
    return FastLlama(tiny_model.model, cache, 64)


def _check_products(fast: FastLlama, slots: LoraSlots, row_adapters: list[LoraAdapter | None], padding: int) -> None:
    """Every group's products over the slots equal `LoraBatch`'s for rows of `row_adapters` (then
    `padding` rows of none), with the step's adapters placed in slots first."""
    groups = fast.lora_groups()
    reference = LoraBatch.of(row_adapters, StackCache(groups), DEVICE, fast.dtype, kernels=False)
    assert reference is not None
    rows = len(row_adapters) + padding
    slots.set_step(reference, len(row_adapters), rows)
    products = slots.products(rows)
    generator = torch.Generator(device="cpu").manual_seed(5)
    for group in groups:
        x = torch.randn(rows, group.inputs, generator=generator).to(DEVICE)
        width = group.parts[-1][2]
        base = torch.randn(rows, width, generator=generator).to(DEVICE)
        want, got = base.clone(), base.clone()
        reference.apply(group.key, x, want)
        products.apply(group.key, x, got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=group.key)
        # padding rows and rows of the base model are left as they were
        plain = [i for i, a in enumerate(row_adapters) if a is None] + list(range(len(row_adapters), rows))
        torch.testing.assert_close(got[plain], base[plain], rtol=0, atol=0)


@torch.inference_mode()
def test_slot_products_equal_the_stacked_products_as_adapters_take_each_others_slots(fast, adapters):
    alpha, beta, gamma = adapters["alpha"], adapters["beta"], adapters["gamma"]
    slots = LoraSlots(fast.lora_groups(), 2, 16, 8, DEVICE, fast.dtype)
    _check_products(fast, slots, [gamma, None, alpha, gamma], padding=2)
    assert slots.holders() == [alpha.id, gamma.id]  # ordered by id, placed in turn
    # beta (rank 4, every linear) takes gamma's slot (rank 16, other linears): the rest of it must be zero
    _check_products(fast, slots, [beta, alpha, None], padding=1)
    assert slots.holders() == [alpha.id, beta.id]
    # gamma again: the least recently used slot is alpha's (placed before beta's in the step before)
    _check_products(fast, slots, [gamma], padding=0)
    assert slots.holders() == [gamma.id, beta.id]
    _check_products(fast, slots, [alpha, beta, alpha], padding=5)
    assert slots.holders() == [alpha.id, beta.id]


@torch.inference_mode()
def test_slots_refuse_more_adapters_or_a_higher_rank(fast, adapters):
    slots = LoraSlots(fast.lora_groups(), 1, 8, 4, DEVICE, fast.dtype)
    with pytest.raises(ValueError, match="2 adapters in one step, 1 LoRA slots"):
        slots.place([adapters["alpha"], adapters["beta"]])
    with pytest.raises(ValueError, match="adapter gamma has rank 16, the LoRA slots 8"):
        slots.place([adapters["gamma"]])
    assert slots.holders() == [None]
    assert slots.place([adapters["alpha"]]) == [0]


def test_the_slots_bytes_are_what_the_pool_plan_reserves(fast, tiny_model):
    """On CUDA (the loaded model said to be there: the reserve reads no device) with decode graphs."""
    slots = LoraSlots(fast.lora_groups(), 3, 8, 4, DEVICE, fast.dtype)
    assert slots.nbytes == slot_bytes(tiny_model.model, 3, 8) > 0
    tiny_model = dataclasses.replace(tiny_model, device=torch.device("cuda"))
    config = EngineConfig(max_running=4)
    with_lora = EngineConfig(max_running=4, lora=LoraLimits(max_loras=3, max_lora_rank=8))
    plain = activation_reserve(tiny_model, config, 1 << 20, graphs=True)
    assert activation_reserve(tiny_model, with_lora, 1 << 20, graphs=True) == plain + slots.nbytes
    assert activation_reserve(tiny_model, with_lora, 1 << 20, graphs=False) == activation_reserve(
        tiny_model, config, 1 << 20, graphs=False
    )


@pytest.fixture(scope="module")
def expected(tiny_model, tiny_model_dir, lora_adapter_dirs) -> dict[str | None, list[list[int]]]:
    ids = [tiny_model.tokenizer(p)["input_ids"] for p in PROMPTS]
    return {
        name: merged_generate(tiny_model_dir, lora_adapter_dirs[name] if name else None, ids, TOKENS, DEVICE)
        for name in NAMES
    }


def _serve(tiny_model, adapter_dirs, jobs, overlap: bool, spacing: float) -> dict[tuple[str | None, int], list[int]]:
    """Greedy requests of `jobs` (``(adapter name or None, prompt index)``), the k-th sent `spacing` x k seconds
    after the first, on an engine with two LoRA slots (`max_loras=2`); each request's tokens."""
    config = EngineConfig(
        lora=LoraLimits(max_loras=2), cpu_autotune=False, max_running=8, max_prefill_tokens=8, async_scheduling=overlap
    )

    async def run_all() -> dict[tuple[str | None, int], list[int]]:
        engine = create_engine(tiny_model, config)
        assert engine.adapters is not None
        for name, path in adapter_dirs.items():
            await asyncio.to_thread(engine.adapters.register, name, path)
        engine.start()
        try:

            async def one(name: str | None, i: int, delay: float) -> list[int]:
                await asyncio.sleep(delay)
                params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
                request = GenerationRequest(PROMPTS[i], params, adapter=name)
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            results = await asyncio.gather(*(one(n, i, spacing * k) for k, (n, i) in enumerate(jobs)))
            return dict(zip(jobs, results, strict=True))
        finally:
            await engine.stop()

    return asyncio.run(run_all())


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_the_engine_replays_decode_steps_with_adapters(tiny_model, lora_adapter_dirs, expected, monkeypatch, overlap):
    """Requests of three adapters and of the base model, two slots: decode steps with adapters run through
    the graphs' slots, and every request gets `generate()`'s greedy tokens with its adapter merged. With
    overlap scheduling, steps of rows with adapters (two at most) chain on the device from the step in
    flight, adapters taking each other's slots meanwhile."""
    record = graphs_on_the_test_device(monkeypatch)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in NAMES]
    results = _serve(tiny_model, lora_adapter_dirs, jobs, overlap, 0.01)
    assert (record.chained_lora > 0) == overlap, record.chained_lora
    graphs = record.made[-1]
    assert graphs.lora is not None and graphs.lora.slots == 2 and graphs.lora.rank == 16
    assert max(adapters for _, adapters in record.steps) == 2  # steps of two adapters replayed
    assert len({h for h in graphs.lora.holders() if h is not None}) == 2
    for (name, i), tokens in results.items():
        assert tokens == expected[name][i], (name, i)


def test_graphs_take_slots_before_their_first_capture_alone(tiny_model, monkeypatch):
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    cfg = tiny_model.model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, 4, cfg.num_key_value_heads, 16, tiny_model.model.dtype, DEVICE)
    graphs = DecodeGraphs(FastLlama(tiny_model.model, cache, 64), 4, 7, capture=False)
    assert not graphs.covers(1, lora=object())  # type: ignore[arg-type]
    graphs.carry_lora(2, 4)
    graphs._graphs[1, "greedy"] = object()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="before the first capture"):
        graphs.carry_lora(2, 4)
