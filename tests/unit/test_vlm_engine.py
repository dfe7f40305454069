"""Vision-language models on the paged engine (issue #40, docs/engine.md "Vision-language models"):
greedy output through lmiserve's engine equals transformers' `generate()` on the processor's output,
token for token, for each family: alone; beside a text-only request and a request with another image;
with a chunk boundary inside the image; under preemption. Tiny random models (tests/helpers/tiny_vlm.py)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_vlm import FAMILIES, build_tiny_vlm_dir, reference_generate, tiny_image

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.media import Image
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runner.vision import PagedVisionRunner, image_token_id
from lmiserve.models.load import load_causal_lm

TOKENS = 6
KV = 4 * 2**20  # bytes of KV pool: plenty for these tiny models


def image_of(seed: int, size: tuple[int, int] = (48, 40)) -> Image:
    pixels = tiny_image(seed, size)
    return Image(pixels, hashlib.sha256(repr(pixels.size).encode() + pixels.tobytes()).hexdigest())


def chat(text: str, images: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory) -> tuple[str, Path, LoadedModel]:
    family = request.param
    path = build_tiny_vlm_dir(family, tmp_path_factory.mktemp(family))
    return family, path, load_causal_lm(path, dtype="fp32", device="cpu")


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


def test_alone_and_beside_text_and_another_image(vlm):
    family, path, loaded = vlm
    first = (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),))
    other = (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),))
    text = (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ())
    (alone,), engine = asyncio.run(serve(loaded, config(), [first]))
    assert isinstance(engine.executor.runner, PagedVisionRunner)
    assert same([alone], [reference(path, *first)]), family
    results, _ = asyncio.run(serve(loaded, config(), [first, text, other]))
    assert same(results, [reference(path, *r) for r in (first, text, other)]), family


def test_a_chunk_boundary_inside_the_image(vlm):
    family, path, loaded = vlm
    request = (prompt_of(loaded, chat("Describe the picture.")), (image_of(3),))
    ids = processed(loaded, *request)
    image_token = image_token_id(loaded.model)
    first = ids.index(image_token)
    # chunks of 5 tokens: a boundary falls inside the image's run of tokens (unless the family's images
    # must not be split: then the scheduler ends the chunk before it and takes the image whole)
    assert any(first < b < first + ids.count(image_token) for b in range(5, len(ids), 5))
    (result,), engine = asyncio.run(serve(loaded, config(max_prefill_tokens=5), [request]))
    assert same([result], [reference(path, *request)]), family


def test_preemption_recomputes_from_the_kept_features(vlm):
    family, path, loaded = vlm
    requests = [(prompt_of(loaded, chat(f"Picture {i}: what is in it?")), (image_of(10 + i),)) for i in range(3)]
    block = 4
    # room for the three prompts and one block more: decoding, they outgrow the pool, and the scheduler
    # preempts one (it recomputes its prompt, image included, when readmitted)
    blocks = sum(-(-len(processed(loaded, *r)) // block) for r in requests) + 1
    small = EngineConfig(
        max_prefill_tokens=512,
        prefill_floor=None,
        block_size=block,
        kv_cache_memory_bytes=blocks * kv_bytes_per_block(loaded.model, block),
    )
    results, engine = asyncio.run(serve(loaded, small, requests, at_once=True, tokens=24))
    assert engine.scheduler.num_preemptions > 0, family
    assert same(results, [reference(path, *r, tokens=24) for r in requests]), family


def test_images_to_a_text_model_are_refused_naming_it(vlm):
    _, _, loaded = vlm
    engine = create_engine(loaded, config())
    request = GenerationRequest(prompt_of(loaded, chat("Two?", images=2)), images=(image_of(1),))
    with pytest.raises(InvalidRequest, match="placeholder"):
        engine.codec.encode(request)
    engine.codec.images = None
    with pytest.raises(InvalidRequest, match=f"`{loaded.name}` does not take images"):
        engine.codec.encode(request)
