"""The draft model's KV pool is planned with the model's from one budget (engine/pool_plan.py, issue #39 item
4): on a memory-bounded device the draft keeps the blocks its drafting rows need, the model's pool takes
the rest, and the draft proposes. On CUDA the old sizing read the free memory again after the model's pool
had taken it: the draft got one block and silently proposed nothing. Here the CPU plays a bounded GPU: a
`memory` reader whose free bytes fall as tensors are allocated (as `torch.cuda.memory_allocated` rises). On
a GPU (LMISERVE_TEST_DEVICE=cuda, benchmarks/gpu_check.py) the same reader follows `torch.cuda.memory_allocated`
itself."""

from __future__ import annotations

import dataclasses
import gc
import logging

import pytest
import torch

from helpers.gpu_memory import fake_gpu_memory
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine import pool_plan
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.speculative.proposers import DraftModelProposer, SpeculationSettings
from lmiserve.models.load import load_causal_lm

GIB = 2**30
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you", "1, 2, 3, 42", "abc abc"]


def allocated_bytes(device: torch.device) -> int:
    """`torch.cuda.memory_allocated` on a GPU; on the CPU its stand-in: the bytes of every tensor alive
    (each storage once)."""
    gc.collect()
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def bounded_device(free: int, device: torch.device):
    """A device with `free` bytes free now: what it reports falls as tensors are allocated, as a GPU's does.
    Tensors that were alive before and are freed since (another test's leftovers, a cache the engine
    replaces) never raise it above `free`: the plan must see exactly `free` when it reads once before any
    pool exists."""
    start = allocated_bytes(device)
    return lambda _: free - max(0, allocated_bytes(device) - start)


@pytest.fixture(scope="module")
def same_draft(tiny_model_dir, tiny_model):
    """The model itself, loaded a second time, as its own draft: greedy drafts are (nearly) all accepted."""
    return load_causal_lm(tiny_model_dir, dtype="fp32", device=str(tiny_model.device))


@pytest.fixture(scope="module")
def int4_draft(tiny_model_dir, tiny_model):
    """The self-draft: the model quantized to int4 (CPU only)."""
    if tiny_model.device.type != "cpu":
        pytest.skip("int4 runs on CPU")
    return load_causal_lm(tiny_model_dir, dtype="int4", device="cpu")


def _speculation(rows: int = 4) -> SpeculationSettings:
    return SpeculationSettings("draft_model", 3, disable_by_batch_size=rows, min_acceptance_rate=0.0)


async def _run(engine, requests) -> list[list[int]]:
    engine.start()
    try:
        return [[e.token.id async for e in engine.generate(r) if e.token is not None] for r in requests]
    finally:
        await engine.stop()


@pytest.mark.parametrize("draft_name", ["same_draft", "int4_draft"], ids=["draft_model", "self_draft"])
async def test_a_memory_bounded_device_still_drafts(request, monkeypatch, tiny_model, draft_name):
    """A device with room for 80 blocks of the model, less than its 8 rows at full context need (128): the
    budget is shared, 40 blocks each (the draft's 5 rows at full context would take 80), and the draft
    model proposes and gets accepted, the output unchanged. (Sized one after the other, the model's pool
    took all 80 blocks and the draft's got the one block left: no drafts.) On a GPU the reserve for the
    steps' activations and the graphs (profiled: test_profile_step.py) is left out of the budget,
    so that the free bytes are the blocks' alone."""
    if tiny_model.device.type == "cuda":
        monkeypatch.setattr(pool_plan, "activation_reserve", lambda *args, **kwargs: 0)
    config = EngineConfig(max_running=8, speculation=_speculation())
    per_block = kv_bytes_per_block(tiny_model.model, config.block_size)
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=24, ignore_eos_token=True)) for p in PROMPTS]
    expected = await _run(create_engine(tiny_model, EngineConfig(max_running=8)), requests)

    draft = request.getfixturevalue(draft_name)
    engine = create_engine(tiny_model, config, draft=draft, memory=bounded_device(80 * per_block, tiny_model.device))
    proposer = engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert await _run(engine, requests) == expected
    info = engine.snapshot().speculation
    assert info is not None and info["num_draft_tokens"] > 0 and info["num_accepted_tokens"] > 0, info
    blocks = engine.runner.num_blocks
    assert proposer.runner.num_blocks == blocks
    # on a GPU what the engine keeps allocated before the plan (the profiled step's leftovers) counts too
    assert blocks == 40 if tiny_model.device.type == "cpu" else 30 <= blocks <= 40, blocks


def test_the_draft_gets_its_rows_at_full_context_and_the_model_the_rest(monkeypatch, tiny_model, same_draft):
    """On a GPU with room, the draft's pool holds the rows that may draft at once at full context and the
    model's pool the rest of the budget: the budget is read once, less both models' profiled activations."""
    fake_gpu_memory(monkeypatch, total=80 * GIB, allocated=10 * GIB)
    cuda = torch.device("cuda")
    loaded = dataclasses.replace(tiny_model, device=cuda, max_context=4096)
    draft = dataclasses.replace(same_draft, device=cuda, max_context=4096)
    config = EngineConfig(max_running=10**6, gpu_memory_utilization=0.5)
    per_block = kv_bytes_per_block(tiny_model.model, config.block_size)
    needs = pool_plan.DraftNeeds(draft, rows=33, activation_bytes=1 * GIB)
    plan = pool_plan.plan_pools(loaded, config, activation_bytes=2 * GIB, draft=needs)
    reserve = sum(int(n * GIB * pool_plan.PROFILE_MARGIN) + pool_plan.PROFILE_SLACK for n in (2, 1))
    assert plan.budget == 40 * GIB - 10 * GIB - reserve
    assert plan.draft_blocks == 33 * 4096 // 16
    assert plan.blocks == (plan.budget - plan.draft_blocks * per_block) // per_block
    assert plan.blocks * per_block + plan.draft_blocks * per_block <= plan.budget


def test_the_drafts_decode_graphs_are_reserved_as_greedy_ones(monkeypatch, tiny_model, same_draft):
    """A draft model proposes greedily (engine/speculative/proposers.py): its decode graphs never sample, so
    its reserve counts a greedy pick's bytes a logit beside the output buffer, the model's a sampled one's."""
    fake_gpu_memory(monkeypatch, total=80 * GIB, allocated=10 * GIB)
    cuda = torch.device("cuda")
    loaded = dataclasses.replace(tiny_model, device=cuda, max_context=4096)
    draft = dataclasses.replace(same_draft, device=cuda, max_context=4096)
    config = EngineConfig(max_running=30, gpu_memory_utilization=0.5)
    without = pool_plan.plan_pools(loaded, config, 2 * GIB, graphs=True, draft=pool_plan.DraftNeeds(draft, 5, GIB))
    needs = pool_plan.DraftNeeds(draft, rows=5, activation_bytes=1 * GIB, graphs=True)
    plan = pool_plan.plan_pools(loaded, config, activation_bytes=2 * GIB, graphs=True, draft=needs)
    vocab, itemsize = same_draft.model.config.vocab_size, same_draft.model.dtype.itemsize
    greedy = pool_plan.graph_pool_bytes(GIB, 2048 + 30, 32, vocab, itemsize, sampled=False)
    assert greedy < pool_plan.graph_pool_bytes(GIB, 2048 + 30, 32, vocab, itemsize)
    assert without.budget - plan.budget == greedy + kv_bytes_per_block(same_draft.model, 16)  # (its padding block)


def test_a_tight_budget_is_shared_block_for_block(tiny_model, same_draft):
    """Less than the draft's rows need: each pool gets as many blocks (the draft never holds more tokens
    than the model's pool), within `kv_cache_memory_bytes`, which bounds both pools together."""
    per_block = kv_bytes_per_block(tiny_model.model, 16)
    config = EngineConfig(max_running=8, kv_cache_memory_bytes=50 * per_block)
    plan = pool_plan.plan_pools(tiny_model, config, draft=pool_plan.DraftNeeds(same_draft, rows=5))
    assert (plan.blocks, plan.draft_blocks) == (25, 25)


def test_each_pools_decode_graphs_padding_block_is_inside_the_budget(tiny_model, same_draft):
    """With decode graphs (CUDA) a runner's pool has one block more than it plans, where padding rows write
    (runner/fast.py): both pools' padding blocks come out of `kv_cache_memory_bytes` (an H200 found the
    model's pool one block over its budget)."""
    per_block = kv_bytes_per_block(tiny_model.model, 16)
    config = EngineConfig(max_running=8, kv_cache_memory_bytes=51 * per_block)
    needs = pool_plan.DraftNeeds(same_draft, rows=5, graphs=True)
    plan = pool_plan.plan_pools(tiny_model, config, graphs=True, draft=needs)
    assert (plan.blocks, plan.draft_blocks) == (24, 24)  # and the two padding blocks: 50 of the 51
    assert pool_plan.kv_pool_blocks(tiny_model, config, graphs=True) == 50


def test_with_room_the_cpu_pools_are_as_before(tiny_model, same_draft):
    """The CPU's default budget is ample for the tiny model: the model's pool holds max_running sequences at
    full context and the draft's its rows at full context, as before the joint plan."""
    config = EngineConfig(max_running=8)
    full = -(-tiny_model.max_context // 16)
    plan = pool_plan.plan_pools(tiny_model, config, draft=pool_plan.DraftNeeds(same_draft, rows=5))
    assert (plan.blocks, plan.draft_blocks) == (8 * full, 5 * full)
    assert pool_plan.kv_pool_blocks(tiny_model, config) == 8 * full


def test_a_draft_pool_too_small_for_one_request_is_a_warning(tiny_model, same_draft, caplog):
    per_block = kv_bytes_per_block(tiny_model.model, 16)
    config = EngineConfig(max_running=4, kv_cache_memory_bytes=6 * per_block, speculation=_speculation())
    with caplog.at_level(logging.INFO, logger="lmiserve.engine.pool_plan"):
        engine = create_engine(tiny_model, config, draft=same_draft)
    # on CUDA each pool's decode graphs have a padding block of their own, inside the budget
    blocks = 3 - int(cuda_graphs.wanted(tiny_model.device, False))
    assert engine.runner.proposer.runner.num_blocks == blocks
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"holds {16 * blocks} tokens, less than one request at full context" in w for w in warnings), warnings


def test_memory_another_process_holds_is_left_to_it(monkeypatch, tiny_model):
    """`gpu_memory_utilization` is each process's share (vLLM's rule), never more than the GPU has free: beside
    another process (a second LLM's engine process: each LLM has one by default on a GPU) the budget is what it
    left, less `OWN_SLACK`, as with both models in one process; alone, or beside a small one, the share."""
    cuda = torch.device("cuda")
    loaded = dataclasses.replace(tiny_model, device=cuda, max_context=4096)
    config = EngineConfig(max_running=10**6, gpu_memory_utilization=0.9)
    reserve = int(2 * GIB * pool_plan.PROFILE_MARGIN) + pool_plan.PROFILE_SLACK
    for others, budget in ((0, 72 - 10), (4 * GIB, 72 - 10), (30 * GIB, 80 - 10 - 30)):
        fake_gpu_memory(monkeypatch, total=80 * GIB, allocated=10 * GIB, others=others)
        want = budget * GIB - (pool_plan.OWN_SLACK if others > 4 * GIB else 0) - reserve
        assert pool_plan.plan_pools(loaded, config, activation_bytes=2 * GIB).budget == want, others
