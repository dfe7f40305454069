"""The step contract across a process boundary: the same engine with its model executed in a child
process (`ProcessExecutor`, the batches pickled through a pipe) gives the tokens of the in-process
executor, a seeded sampled row's included. `ProcessExecutor` is the benchmark's
(benchmarks/process_executor.py, measured by benchmarks/executor_process.py), not the package's."""

from __future__ import annotations

import asyncio
import functools
import importlib
from pathlib import Path

import pytest

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.executors.in_process import InProcessExecutor
from lmiserve.engine.factory import create_engine
from lmiserve.models.load import load_causal_lm

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "Hello world! How are you", "Numbers like 1, 2, 3"]


async def _run(engine) -> list[list[int]]:
    async def one(i: int, prompt: str) -> list[int]:
        seeded = i == 2  # one sampled row: its generator lives in the executor
        params = SamplingParams(max_new_tokens=10, ignore_eos_token=True, do_sample=seeded, seed=5 if seeded else None)
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token is not None]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


async def test_a_child_process_executes_the_same_batches_to_the_same_tokens(tiny_model, tiny_model_dir, monkeypatch):
    if tiny_model.device.type != "cpu":
        pytest.skip("the child loads the model on the CPU")
    # the spawned child unpickles its entry point by module name: the repository root on its sys.path
    monkeypatch.syspath_prepend(str(ROOT))
    process_executor = importlib.import_module("benchmarks.process_executor")
    ProcessExecutor, paged_fast_runner = process_executor.ProcessExecutor, process_executor.paged_fast_runner
    # no prefix cache: the pool's bookkeeping is shared by both executors, its memory is each one's own
    engine = create_engine(tiny_model, EngineConfig(max_running=4, enable_prefix_caching=False))
    runner = engine.runner
    assert isinstance(engine.executor, InProcessExecutor)
    load = functools.partial(load_causal_lm, str(tiny_model_dir), dtype="fp32", device="cpu")
    build = functools.partial(paged_fast_runner, load, runner.num_blocks, runner.block_size, 4)
    child = ProcessExecutor(build)
    engine.start()
    try:
        here = await _run(engine)
        engine.executor = child
        there = await _run(engine)
        assert there == here
        assert all(len(tokens) == 10 for tokens in there)
    finally:
        await engine.stop()
        child.close()
    assert not child._process.is_alive()
