"""Serving the tiny vision-language models (helpers/tiny_vlm.py) through lmiserve's engine, for the VLM
engine tests (tests/unit/test_vlm_engine.py, tests/unit/test_vlm_prefix.py)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from helpers.tiny_vlm import reference_generate, tiny_image
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
) -> tuple[list[tuple[list[int], int]], Any]:
    """Each request's greedy tokens (EOS ignored) and cached prompt tokens; the engine (stopped). Requests
    join a running batch a little apart; `at_once`: all submitted before the first step; `one_by_one`:
    each after the one before finished."""
    engine = create_engine(loaded, config)
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


def config(**extra: Any) -> EngineConfig:
    return EngineConfig(kv_cache_memory_bytes=KV, **extra)
