"""Seeded (and greedy) engine outputs on the tiny model, pinned to what the engine produced before
the performance work (tests/golden/seeded_tokens.json). A faster step, vectorized sampling or a
fused forward must not change a single token for the same seed.

Regenerate only on purpose: LMISERVE_REPIN=1 pytest tests/unit/test_sampling_pinned.py
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "seeded_tokens.json"
PROMPTS = ["The quick brown fox", "Hello world! How are you", "Numbers like 1, 2, 3", "naïve café"]
CASES = {
    "greedy": dict(),
    "plain": dict(do_sample=True),
    "temperature": dict(do_sample=True, temperature=0.7),
    "top_k": dict(do_sample=True, top_k=20),
    "top_p": dict(do_sample=True, top_p=0.8, temperature=1.3),
    "min_p_typical": dict(do_sample=True, min_p=0.02, typical_p=0.9),
    "penalties": dict(do_sample=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    "greedy_penalty": dict(repetition_penalty=1.5),
    "min_new": dict(do_sample=True, min_new_tokens=10),
}


GREEDY_CASES = ("greedy", "greedy_penalty")


async def _run(loaded, config: EngineConfig) -> dict[str, list[list[int]]]:
    engine = create_engine(loaded, config)
    engine.start()

    async def one(prompt: str, seed: int, params: dict) -> list[int]:
        sp = SamplingParams(seed=seed, max_new_tokens=12, ignore_eos_token=True, **params)
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, sp)) if e.token is not None]

    try:
        result = {}
        for name, params in CASES.items():  # all prompts of a case run concurrently in one batch
            result[name] = list(await asyncio.gather(*(one(p, 1000 + i, params) for i, p in enumerate(PROMPTS))))
        return result
    finally:
        await engine.stop()


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_seeded_outputs_are_pinned(tiny_model, batch_invariant: bool):
    got = asyncio.run(_run(tiny_model, EngineConfig(batch_invariant=batch_invariant)))
    if os.environ.get("LMISERVE_REPIN") and not batch_invariant:
        GOLDEN.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in got.items()) + "\n}\n")
    golden = json.loads(GOLDEN.read_text())
    if tiny_model.device.type != "cpu":
        # The pinned streams are the CPU generator's; a CUDA generator draws other numbers from the same
        # seed. There: greedy as pinned, and sampled rows reproducible from their seeds run after run.
        assert {k: got[k] for k in GREEDY_CASES} == {k: golden[k] for k in GREEDY_CASES}
        assert got == asyncio.run(_run(tiny_model, EngineConfig(batch_invariant=batch_invariant)))
        return
    assert got == golden
