"""The profiling step that sizes the KV pool on CUDA (engine/factory.py, issue #25 point 4): the step
itself runs on any device (here, the CPU) on both paged runners; the CUDA measurement around it runs on a
GPU only (benchmarks/gpu_check.py); the budget's arithmetic is checked with the GPU's figures given."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.gpu_memory import fake_gpu_memory
from lmiserve.engine import factory, pool_plan
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.engine.runner.generic import PagedGenericRunner


def _runner_of(model, cls):
    made = []

    def runner_of(blocks: int):
        kwargs = {"eos_token_ids": model.eos_token_ids}
        if cls is PagedFastRunner:
            kwargs |= {"max_slots": 4, "max_context": model.max_context}
        runner = cls(model.model, num_blocks=blocks, block_size=16, **kwargs)
        made.append(runner)
        return runner

    return runner_of, made


@pytest.mark.parametrize("cls", [PagedFastRunner, PagedGenericRunner], ids=["fast", "generic"])
def test_the_largest_step_runs_on_a_pool_just_big_enough_and_is_forgotten(tiny_model, cls):
    runner_of, made = _runner_of(tiny_model, cls)
    tokens = pool_plan.largest_step_tokens(EngineConfig(max_prefill_tokens=64, max_running=8), tiny_model.max_context)
    assert tokens == 72
    pool = factory.run_profile_step(runner_of, tokens, 16)
    (runner,) = made
    assert runner.num_blocks == 5 and pool == runner.kv_bytes > 0
    assert runner._requests == {}  # the profiling request is gone again


def test_the_profile_runs_the_samplers_largest_step_too(tiny_model, monkeypatch):
    """`sampler` (the batch limit's rows, the vocabulary): after the prompt step, while its pool is still
    held, the eager sampler runs that many rows of logits with every stage it has (vLLM's dummy sampler
    run): its tensors are in the profile's peak. Each row is sampled (none fails)."""
    from lmiserve.engine.runner import sampling

    seen = []
    real = sampling.sample_rows

    def recorded(logits, rows):  # noqa: ANN001, ANN202
        seen.append((tuple(logits.shape), rows))
        results = real(logits, rows)
        seen.append(results)
        return results

    monkeypatch.setattr(sampling, "sample_rows", recorded)
    runner_of, made = _runner_of(tiny_model, PagedFastRunner)
    vocab = tiny_model.model.config.vocab_size
    factory.run_profile_step(runner_of, 40, 16, sampler=(24, vocab))
    (runner,) = made
    assert runner._requests == {}
    profile = [entry for entry in seen if isinstance(entry, tuple) and entry[0] == (24, vocab)]
    assert len(profile) == 1
    rows = profile[0][1]
    params = rows[0].params
    assert all(row.params == params for row in rows) and len({row.seed for row in rows}) == 24
    assert params.top_p < 1 and params.typical_p < 1 and params.top_k and params.min_p > 0
    assert params.repetition_penalty != 1 and params.top_n_tokens == 20 and params.temperature != 1
    results = seen[seen.index(profile[0]) + 1]
    assert len(results) == 24 and not any(isinstance(r, Exception) for r in results)


def test_a_sampler_profile_that_fails_keeps_the_steps_figure(tiny_model, monkeypatch, caplog):
    """The sampler's profile failing (out of memory at a large batch limit and vocabulary, say) costs its
    share of the reserve, logged, not the prompt step's measurement (the fixed reserve would replace it)."""

    def fails(rows, vocab, device):  # noqa: ANN001, ANN202
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(factory, "sample_profile", fails)
    runner_of, made = _runner_of(tiny_model, PagedFastRunner)
    with caplog.at_level("WARNING", logger=factory.__name__):
        pool = factory.run_profile_step(runner_of, 40, 16, sampler=(24, 512))
    (runner,) = made
    assert pool == runner.kv_bytes > 0 and runner._requests == {}
    assert "profiling the sampler over 24 rows failed (CUDA out of memory)" in caplog.text


def test_on_cuda_the_profile_includes_the_sampler_and_engines_ask_for_the_batch_limits_rows(tiny_model, monkeypatch):
    """`profile_step_memory` on CUDA (its memory readings given here): the peak over the prompt step and
    the sampler's step, less the pool; `create_engine` asks for the batch limit's rows of the vocabulary."""
    calls = []
    monkeypatch.setattr(
        factory,
        "run_profile_step",
        lambda runner_of, tokens, size, prompt=None, sampler=None: calls.append(sampler) or 0,
    )
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**20)
    assert factory.profile_step_memory(torch.device("cuda"), None, 64, 16, sampler=(8, 512)) == 3 * 2**20
    assert calls == [(8, 512)]
    asked = []
    monkeypatch.setattr(factory, "profile_step_memory", lambda *args: asked.append(args[-1]))
    factory.create_engine(tiny_model, EngineConfig(max_running=6))
    assert asked == [(6, tiny_model.model.config.vocab_size)]


def test_the_largest_step_is_bounded_by_the_context():
    assert pool_plan.largest_step_tokens(EngineConfig(max_prefill_tokens=2048, max_running=32), 256) == 256


def test_the_largest_step_is_bounded_by_the_step_budget():
    """max_num_batched_tokens: the profiled step is no larger than any step the scheduler plans."""
    config = EngineConfig(max_prefill_tokens=2048, max_running=32, max_step_tokens=512)
    assert pool_plan.largest_step_tokens(config, 8192) == 512


def test_profiling_measures_on_cuda_only(tiny_model):
    runner_of, made = _runner_of(tiny_model, PagedFastRunner)
    assert factory.profile_step_memory(torch.device("cpu"), runner_of, 32, 16) is None
    assert made == []  # nothing ran


def test_the_profiled_activations_replace_the_fixed_reserve(monkeypatch, tiny_model):
    """On CUDA the pool gets gpu_memory_utilization of the GPU less the allocated weights less the
    activations (profiled, with their margin; else the fixed reserve)."""
    gib = 2**30
    fake_gpu_memory(monkeypatch, total=80 * gib, allocated=10 * gib)
    loaded = dataclasses.replace(tiny_model, device=torch.device("cuda"), max_context=10**9)
    config = EngineConfig(max_running=10**9, gpu_memory_utilization=0.5)
    per_block = kv_bytes_per_block(tiny_model.model, config.block_size)
    fixed = pool_plan.kv_pool_blocks(loaded, config)
    assert fixed == (40 * gib - 10 * gib - pool_plan.GPU_ACTIVATION_RESERVE) // per_block
    profiled = pool_plan.kv_pool_blocks(loaded, config, activation_bytes=5 * gib)
    reserve = int(5 * gib * pool_plan.PROFILE_MARGIN) + pool_plan.PROFILE_SLACK
    assert profiled == (40 * gib - 10 * gib - reserve) // per_block
    assert (
        pool_plan.kv_pool_blocks(loaded, dataclasses.replace(config, kv_cache_memory_bytes=per_block * 7), 5 * gib) == 7
    )


def test_decode_graphs_memory_is_left_free_too(monkeypatch, tiny_model):
    """With decode graphs (CUDA, not enforce_eager) the pool also leaves their pool free: the profiled
    activations scaled to the largest capture size, and that step's logits, their float32 output buffer and
    a sampled graph's pick."""
    gib = 2**30
    fake_gpu_memory(monkeypatch, total=80 * gib, allocated=10 * gib)
    loaded = dataclasses.replace(tiny_model, device=torch.device("cuda"), max_context=10**9)
    config = EngineConfig(max_running=30, max_prefill_tokens=2018, gpu_memory_utilization=0.5)
    per_block = kv_bytes_per_block(tiny_model.model, config.block_size)
    eager = pool_plan.kv_pool_blocks(loaded, config, activation_bytes=2048 * 2**20)
    graphs = pool_plan.kv_pool_blocks(loaded, config, activation_bytes=2048 * 2**20, graphs=True)
    # a 32-row decode step (capture size for 30 rows) of a 2,048-token step's 2 GiB: 32 MiB, with the margin,
    # and 32 rows of logits over the tiny model's 512 words in fp32 (its dtype), in the float32 output buffer,
    # and a sampled pick's intermediates (32 B a logit, runner/graph_sampling.py)
    graph_bytes = int(32 * 2**20 * pool_plan.PROFILE_MARGIN) + 32 * 512 * (4 + 4 + 32)
    assert graph_bytes == pool_plan.graph_pool_bytes(2048 * 2**20, 2048, 32, 512, 4)
    reserve = int(2048 * 2**20 * pool_plan.PROFILE_MARGIN) + pool_plan.PROFILE_SLACK
    assert eager == (40 * gib - 10 * gib - reserve) // per_block
    # and the graphs' padding block, one past the pool's blocks
    assert graphs == (40 * gib - 10 * gib - reserve - graph_bytes) // per_block - 1
    # with prompt rows folded into the graphs (cuda_graph_prompt_tokens=20), the largest graph holds 30 + 20
    # rows: 56 (a capture size), so its activations' share and logits are reserved for 56 rows
    folded = pool_plan.kv_pool_blocks(
        loaded, dataclasses.replace(config, graph_prompt_tokens=20), activation_bytes=2048 * 2**20, graphs=True
    )
    folded_bytes = pool_plan.graph_pool_bytes(2048 * 2**20, 2048, 56, 512, 4)
    assert folded_bytes > graph_bytes
    assert folded == (40 * gib - 10 * gib - reserve - folded_bytes) // per_block - 1
