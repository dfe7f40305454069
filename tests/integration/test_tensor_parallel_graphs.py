"""Decode graphs under tensor parallelism: each rank replays its shard's decode steps from the graphs (on CUDA captured,
its NCCL all-reduces inside; here on a CPU their fixed buffers run without a capture, gloo's collectives inside:
helpers/tp_graphs.py), both ranks the same graph sizes step after step, and the greedy tokens are one process's
(eager); with LoRA adapters the graphs' adapter slots carry each rank's cut of the adapters, and the tokens are
`generate()`'s with each adapter merged by PEFT."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.lora_adapters import merged_generate
from helpers.tp_graphs import GRAPH_LOG, load_shell_with_graphs
from lmiserve.config import Settings
from lmiserve.core.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = ["Hello world", "The quick brown fox", "Numbers like 1, 2, 3", "once upon a time"]
TOKENS = 12


def _engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch, log: Path, **options: str):  # noqa: ANN202
    from lmiserve.models import compose
    from lmiserve.models.load import load_model_shell

    real = compose.worker_spec
    monkeypatch.setattr(
        compose, "worker_spec", lambda *a, **k: dataclasses.replace(real(*a, **k), load_shell=load_shell_with_graphs)
    )
    monkeypatch.setenv(GRAPH_LOG, str(log))
    settings = Settings.from_options(
        {
            "model_id": str(model_dir),
            "device": "cpu",
            "tensor_parallel_degree": "2",
            "max_rolling_batch_size": "4",
            **options,
        }
    )
    return compose.build_tensor_parallel_engine(load_model_shell(model_dir, device="cpu"), settings, 2)


def _run(engine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:  # noqa: ANN001
    async def run() -> list[list[int]]:
        engine.start()
        try:

            async def one(ids: list[int], adapter: str | None) -> list[int]:
                params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
                request = GenerationRequest("", params, prompt_ids=ids, adapter=adapter)
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            return list(await asyncio.gather(*(one(*job) for job in jobs)))
        finally:
            await engine.stop()

    return asyncio.run(run())


def _graph_steps(log: Path, chained: bool = False) -> dict[str, list]:
    """Each worker's graph sizes, step after step (by its pid); with `chained`, (size, whether the step chained)."""
    steps: dict[str, list] = defaultdict(list)
    for line in log.read_text().splitlines():
        pid, size, chain = line.split()
        steps[pid].append((int(size), chain == "1") if chained else int(size))
    return steps


def _ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def test_decode_graphs_over_two_ranks_give_one_processs_tokens(tiny_model_dir, monkeypatch, tmp_path):
    ids = _ids(tiny_model_dir)
    log = tmp_path / "graph-steps"
    replayed = _run(_engine(tiny_model_dir, monkeypatch, log), [(i, None) for i in ids])
    expected = merged_generate(tiny_model_dir, None, ids, TOKENS)
    for got, want in zip(replayed, expected, strict=True):
        assert got[: len(want)] == want
    steps = _graph_steps(log)
    assert len(steps) == 2, steps  # both ranks replayed
    first, second = steps.values()
    assert first == second and len(first) >= TOKENS - 1, steps  # the same sizes, step after step


def test_decode_graphs_over_two_ranks_carry_lora_adapters(tiny_model_dir, lora_adapter_dirs, monkeypatch, tmp_path):
    ids = _ids(tiny_model_dir)[:2]
    log = tmp_path / "graph-steps"
    engine = _engine(tiny_model_dir, monkeypatch, log, enable_lora="true", max_lora_rank="16")
    assert engine.adapters is not None
    for name in ("alpha", "beta"):
        engine.adapters.register(name, str(lora_adapter_dirs[name]))
    jobs = [(i, name) for i in ids for name in ("alpha", "beta", None)]
    replayed = _run(engine, jobs)
    for (prompt, name), got in zip(jobs, replayed, strict=True):
        (want,) = merged_generate(tiny_model_dir, lora_adapter_dirs[name] if name else None, [prompt], TOKENS)
        assert got[: len(want)] == want, name
    steps = _graph_steps(log)
    assert len(steps) == 2 and len(set(map(tuple, steps.values()))) == 1, steps


def test_overlapped_steps_over_two_ranks_chain_on_the_devices(tiny_model_dir, monkeypatch, tmp_path, capfd):
    """Overlap scheduling over the ranks: the leader sends a step before the one before it is answered, and the ranks
    launch it behind that step, its rows taking their inputs from that step's tokens on the device (chained), every
    rank alike. Requests join and leave meanwhile: one ends at a stop token nobody could foresee (its row in the
    chained step computed in vain), one asks for top tokens (sampled on the host: the step after it is not chained).
    The tokens are `generate()`'s."""
    ids = _ids(tiny_model_dir)
    log = tmp_path / "graph-steps"
    engine = _engine(tiny_model_dir, monkeypatch, log, async_scheduling="true")
    expected = merged_generate(tiny_model_dir, None, ids, TOKENS)
    stop = expected[1][4]
    cut = expected[1].index(stop) + 1

    async def run() -> list[list[int]]:
        engine.start()
        try:

            async def one(i: int, after: int, tokens: int = TOKENS, **options: object) -> list[int]:
                while engine.steps < after:  # later requests join a running batch
                    await asyncio.sleep(0.001)
                params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True, **options)  # type: ignore[arg-type]
                request = GenerationRequest("", params, prompt_ids=ids[i])
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            return list(
                await asyncio.gather(
                    one(0, 0), one(1, 0, stop_token_ids=[stop]), one(2, 4, 3, top_n_tokens=2), one(3, 7)
                )
            )
        finally:
            await engine.stop()

    results = asyncio.run(run())
    assert results == [expected[0], expected[1][:cut], expected[2][:3], expected[3]]
    assert engine.steps_ahead > 0 and engine.executor.sent_ahead > 0
    steps = _graph_steps(log, chained=True)
    assert len(steps) == 2, steps
    first, second = steps.values()
    assert first == second, steps  # every rank replayed and chained alike
    assert sum(chain for _, chain in first) > 0, first
    # rank 0's account, logged when the leader closes the workers (their stderr is this process's)
    counts = re.search(r"rank 0: (\d+) steps, (\d+) \(\d+%\) launched behind", capfd.readouterr().err)
    assert counts is not None and 0 < int(counts[2]) < int(counts[1]), counts
