"""Tensor parallelism on the bundled SmolLM2-135M (issue #25): its 9 heads and 3 KV heads split over 3
CPU worker processes (TP=2 is refused: 2 divides neither), and the engine's greedy tokens are the whole
model's in one process. Three processes on a small machine are slow (about a second a step on two cores):
a few prompts, 32 tokens, all in one batch."""

from __future__ import annotations

import asyncio

import pytest

from lmiserve.config import Settings
from lmiserve.core.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 32


async def _greedy(engine) -> list[list[int]]:
    async def one(prompt: str) -> list[int]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos_token=True)
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token is not None]

    engine.start()
    try:
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
    finally:
        await engine.stop()


def test_tp2_is_refused_with_one_line(smollm_dir):
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    settings = Settings.from_options({"model_id": str(smollm_dir), "device": "cpu", "tensor_parallel_degree": "2"})
    with pytest.raises(ValueError, match="^tensor_parallel_degree=2 does not divide the model's 9 attention heads$"):
        build_tensor_parallel_engine(load_model_shell(smollm_dir, device="cpu"), settings, 2)


def test_tp3_greedy_tokens_are_the_whole_models(smollm_dir, smollm_model):
    from lmiserve.models.compose import build_engine, build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    options = {"model_id": str(smollm_dir), "device": "cpu", "dtype": "fp32"}
    whole = asyncio.run(_greedy(build_engine(smollm_model, Settings.from_options(options))))
    settings = Settings.from_options({**options, "tensor_parallel_degree": "3"})
    split = asyncio.run(_greedy(build_tensor_parallel_engine(load_model_shell(smollm_dir, device="cpu"), settings, 3)))
    agree = [
        next((i for i, (a, b) in enumerate(zip(s, w, strict=True)) if a != b), NEW_TOKENS)
        for s, w in zip(split, whole, strict=True)
    ]
    assert all(len(tokens) == NEW_TOKENS for tokens in split)
    assert split == whole, f"tokens agreeing before the first difference, by prompt: {agree}"
