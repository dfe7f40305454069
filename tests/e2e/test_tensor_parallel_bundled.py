"""Tensor parallelism on the bundled SmolLM2-135M (issue #25): its 9 heads and 3 KV heads split over 3
CPU worker processes (TP=2 is refused: 2 divides neither), and the engine's greedy tokens are the whole
model's in one process; with LoRA adapters (issue #36) they are the PEFT-merged model's. Three processes on
a small machine are slow (about a second a step on two cores): a few prompts, 32 tokens, all in one batch."""

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


def test_tp3_with_lora_adapters_gives_the_peft_merged_models_greedy_tokens(smollm_dir, smollm_model, tmp_path):
    """Issue #36: LoRA over tensor parallelism. Two PEFT adapters of the bundled model (rank 4 on all seven
    projections, rank 16 rsLoRA on the MLP), each rank holding its shard of them: the greedy tokens of every
    prompt, with each adapter and with none, all in one batch, are those of `generate()` of the model with
    that adapter merged by PEFT (`merge_and_unload`)."""
    from helpers.lora_adapters import ALL_MODULES, AdapterSpec, make_adapter, merged_generate
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    specs = (
        AdapterSpec("all4", 4, ALL_MODULES, seed=12, b_std=0.01),
        AdapterSpec("mlp16", 16, ("gate_proj", "up_proj", "down_proj"), seed=13, alpha=32.0, b_std=0.005, rslora=True),
    )
    folders = {spec.name: make_adapter(smollm_dir, tmp_path / spec.name, spec) for spec in specs}
    ids = [smollm_model.tokenizer(p)["input_ids"] for p in PROMPTS]
    names = [None, *folders]
    options = {"model_id": str(smollm_dir), "device": "cpu", "dtype": "fp32", "tensor_parallel_degree": "3"}
    settings = Settings.from_options({**options, "enable_lora": "true"})
    engine = build_tensor_parallel_engine(load_model_shell(smollm_dir, device="cpu"), settings, 3)
    assert engine.adapters is not None
    for name, folder in folders.items():
        engine.adapters.register(name, folder)

    async def run() -> dict[tuple[str | None, int], list[int]]:
        async def one(i: int, name: str | None) -> list[int]:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos_token=True)
            request = GenerationRequest("", params, prompt_ids=ids[i], adapter=name)
            return [e.token.id async for e in engine.generate(request) if e.token is not None]

        engine.start()
        try:
            jobs = [(name, i) for i in range(len(ids)) for name in names]
            return dict(zip(jobs, await asyncio.gather(*(one(i, name) for name, i in jobs)), strict=True))
        finally:
            await engine.stop()

    split = asyncio.run(run())
    merged = {name: merged_generate(smollm_dir, folders[name] if name else None, ids, NEW_TOKENS) for name in names}
    for (name, i), tokens in split.items():
        assert len(tokens) == NEW_TOKENS
        first = next((n for n, (a, b) in enumerate(zip(tokens, merged[name][i], strict=True)) if a != b), None)
        assert first is None, f"adapter {name}, prompt {i}: the tokens differ from the merged model's at {first}"
    assert len({tuple(map(tuple, merged[name])) for name in names}) == len(names)  # each adapter changes them
