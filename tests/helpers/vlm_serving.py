"""Serving the tiny vision-language models (helpers/tiny_vlm.py) through lmiserve's engine, for the VLM
engine tests (tests/unit/test_vlm_engine.py, tests/unit/test_vlm_prefix.py)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import torch

from helpers.tiny_vlm import load_tiny_vlm, reference_generate, reference_inputs, tiny_image
from lmiserve.core.media import Image
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel

TOKENS = 6
KV = 4 * 2**20  # bytes of KV pool: plenty for these tiny models


def image_of(seed: int, size: tuple[int, int] = (48, 40)) -> Image:
    pixels = tiny_image(seed, size)
    return Image(pixels, hashlib.sha256(repr(pixels.size).encode() + pixels.tobytes()).hexdigest())


def chat(text: str, images: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


def prompt_of(loaded: LoadedModel, messages: list[dict[str, Any]]) -> str:
    assert loaded.processor is not None
    return loaded.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


async def serve(
    loaded: LoadedModel,
    config: EngineConfig,
    requests: list[tuple[str, tuple[Image, ...]]],
    *,
    one_by_one: bool = False,
    at_once: bool = False,
    tokens: int = TOKENS,
    engine: Any = None,
) -> tuple[list[tuple[list[int], int]], Any]:
    """Each request's greedy tokens (EOS ignored) and cached prompt tokens; the engine (stopped). Requests
    join a running batch a little apart; `at_once`: all submitted before the first step; `one_by_one`:
    each after the one before finished. `engine`: one built already (not started), in place of `loaded`'s."""
    engine = engine or create_engine(loaded, config)
    engine.start()
    params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)

    def outcome(events: list[Any]) -> tuple[list[int], int]:
        finish = events[-1].finish
        assert finish is not None and finish.error is None, finish
        return [e.token.id for e in events if e.token is not None], finish.cached_tokens

    async def one(i: int, prompt: str, images: tuple[Image, ...]) -> tuple[list[int], int]:
        if not one_by_one:
            await asyncio.sleep(0.005 * i)
        return outcome([e async for e in engine.generate(GenerationRequest(prompt, params, images=images))])

    async def drained(handle: Any) -> tuple[list[int], int]:
        return outcome([e async for e in engine._drain(handle)])

    try:
        if at_once:  # submitted synchronously: the first step sees them all
            handles = [engine.submit(GenerationRequest(p, params, images=im)) for p, im in requests]
            return list(await asyncio.gather(*(drained(h) for h in handles))), engine
        if one_by_one:
            return [await one(i, p, im) for i, (p, im) in enumerate(requests)], engine
        return list(await asyncio.gather(*(one(i, p, im) for i, (p, im) in enumerate(requests)))), engine
    finally:
        await engine.stop()


def same(results: list[tuple[list[int], int]], references: list[list[int]]) -> bool:
    """Each result begins with its reference (generate() stops at EOS, the engine here ignores it)."""
    return len(results) == len(references) and all(r[0][: len(ref)] == ref for r, ref in zip(results, references))


def processed(loaded: LoadedModel, prompt: str, images: tuple[Image, ...]) -> list[int]:
    """The prompt's ids as the processor expands its images."""
    assert loaded.processor is not None
    out = loaded.processor(text=[prompt], images=[[im.pixels for im in images]], return_tensors="np")
    return [int(i) for i in out["input_ids"][0]]


def reference(path: Path, prompt: str, images: tuple[Image, ...], tokens: int = TOKENS) -> list[int]:
    return reference_generate(path, prompt, [im.pixels for im in images], tokens)


def forward_prompt_logprobs(path: Path, prompt: str, images: tuple[Image, ...]) -> tuple[list[int], torch.Tensor]:
    """The processor's ids of the prompt and, for each position past the first, its token's logprob under
    transformers' forward of the VLM (a fresh load of `path`)."""
    model, _ = load_tiny_vlm(str(path))
    inputs = reference_inputs(path, prompt, [im.pixels for im in images])
    ids = inputs["input_ids"][0]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(**inputs).logits[0].float(), -1)
    return ids.tolist(), torch.tensor([float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))])


async def served_prompt_logprobs(
    loaded: LoadedModel, config: EngineConfig, prompt: str, images: tuple[Image, ...]
) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and logprobs (past the first) as lmiserve's engine reports them (decoder_input_details)."""
    engine = create_engine(loaded, config)
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=1, decoder_input_details=True)
        events = [e async for e in engine.generate(GenerationRequest(prompt, params, images=images))]
    finally:
        await engine.stop()
    finish = events[-1].finish
    assert finish is not None and finish.prefill is not None and finish.error is None
    return [t.id for t in finish.prefill], torch.tensor([t.logprob for t in finish.prefill[1:]])


def config(**extra: Any) -> EngineConfig:
    return EngineConfig(kv_cache_memory_bytes=KV, **extra)
