"""Vision-language models on the paged engine (issue #40, docs/engine.md "Vision-language models"):
greedy output through lmiserve's engine equals transformers' `generate()` on the processor's output,
token for token, for each family: alone; beside a text-only request and a request with another image;
with a chunk boundary inside the image; under preemption. Tiny random models (tests/helpers/tiny_vlm.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny_vlm import FAMILIES
from helpers.vlm_serving import (
    TOKENS,
    chat,
    config,
    forward_prompt_logprobs,
    image_of,
    processed,
    prompt_of,
    reference,
    same,
    serve,
    served_prompt_logprobs,
)
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runner.vision import PagedVisionRunner, image_token_id
from lmiserve.engine.speculative.proposers import SpeculationSettings
from lmiserve.models.load import load_causal_lm


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tiny_vlm_dir) -> tuple[str, Path, LoadedModel]:
    family = request.param
    path = tiny_vlm_dir(family)
    return family, path, load_causal_lm(path, dtype="fp32", device="cpu")


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
    (result,), _ = asyncio.run(serve(loaded, config(max_prefill_tokens=5), [request]))
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
    # every step on lmiserve's forward: a recompute's chunk past its prompt too (M-RoPE: the prompt's 3-D positions,
    # then each generated token's plus the rope delta)
    assert engine.executor.runner.steps["vlm"] == 0, (family, engine.executor.runner.steps)


def test_images_to_a_text_model_are_refused_naming_it(vlm):
    _, _, loaded = vlm
    engine = create_engine(loaded, config())
    request = GenerationRequest(prompt_of(loaded, chat("Two?", images=2)), images=(image_of(1),))
    with pytest.raises(InvalidRequest, match="placeholder"):
        engine.codec.encode(request)
    engine.codec.images = None
    with pytest.raises(InvalidRequest, match=f"`{loaded.name}` does not take images"):
        engine.codec.encode(request)


def test_an_image_placeholder_without_an_image_is_refused(vlm):
    """A text-only prompt holding the model's image token (its placeholder typed as text, or given as ids)
    would reach the model with no features behind it: a 400, not a forward over a bare placeholder."""
    _, _, loaded = vlm
    engine = create_engine(loaded, config())
    token = image_token_id(loaded.model)
    text = loaded.tokenizer.decode([token])
    with pytest.raises(InvalidRequest, match="image token"):
        engine.codec.encode(GenerationRequest(prompt=f"Look: {text} here"))
    with pytest.raises(InvalidRequest, match="image token"):
        engine.codec.encode(GenerationRequest(prompt="", prompt_ids=[1, token, 2]))
    assert engine.codec.encode(GenerationRequest(prompt="Look: no image here"))


@pytest.mark.parametrize("chunk", [2048, 5])
def test_prompt_logprobs_equal_the_models_forward(vlm, chunk):
    """Every prompt position's logits as transformers' forward gives them on the processor's output (the
    image features in place, M-RoPE positions, Gemma 3's image tokens attending both ways), whole or in
    chunks of 5 tokens (a boundary inside the image)."""
    family, path, loaded = vlm
    prompt, images = prompt_of(loaded, chat("Describe the picture.")), (image_of(4),)
    ids, expected = forward_prompt_logprobs(path, prompt, images)
    served, got = asyncio.run(served_prompt_logprobs(loaded, config(max_prefill_tokens=chunk), prompt, images))
    assert served == ids
    assert torch.allclose(got, expected, atol=1e-4), (family, float((got - expected).abs().max()))


def test_batch_invariant_serves_images_as_generate_does(vlm):
    family, path, loaded = vlm
    requests = [
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(5),)),
        (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]), ()),
    ]
    results, _ = asyncio.run(serve(loaded, config(batch_invariant=True), requests))
    assert same(results, [reference(path, *r) for r in requests]), family


def test_two_images_in_one_prompt(vlm):
    family, path, loaded = vlm
    request = (prompt_of(loaded, chat("Compare the two pictures.", images=2)), (image_of(6), image_of(7, (56, 40))))
    (result,), _ = asyncio.run(serve(loaded, config(max_prefill_tokens=7), [request]))
    assert same([result], [reference(path, *request)]), family


def test_prompt_lookup_drafts_give_the_greedy_tokens(vlm):
    """Prompt lookup (ngram) drafts from an image prompt's tokens and what it generated, verified by the VLM's forward
    (a chunk past the prompt: M-RoPE's shifted by the rope delta): the greedy tokens of `generate()`."""
    family, path, loaded = vlm
    requests = [
        (
            prompt_of(loaded, chat("Say it again and again: a red fox, a red fox, a red fox, a red fox.")),
            (image_of(8),),
        ),
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(9),)),
    ]
    results, engine = asyncio.run(
        serve(loaded, config(speculation=SpeculationSettings("ngram", 3, 1, 3)), requests, tokens=16)
    )
    assert same(results, [reference(path, *r, tokens=16) for r in requests]), family
    assert engine.speculation is not None and engine.speculation.describe()["num_drafts"] > 0, family


def test_a_draft_model_is_refused_at_start(vlm):
    _, _, loaded = vlm
    with pytest.raises(ValueError, match="draft model is not served with a vision-language model"):
        create_engine(loaded, config(speculation=SpeculationSettings("draft_model", 3)), draft=loaded)


def test_an_image_that_fails_to_encode_fails_its_request_only(vlm, monkeypatch):
    family, _, loaded = vlm
    engine = create_engine(loaded, config())
    runner = engine.runner
    assert isinstance(runner, PagedVisionRunner)

    def broken(*args, **kwargs):
        raise RuntimeError("the vision tower broke")

    monkeypatch.setattr(runner.inner, "get_image_features", broken)
    text = (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]), ())
    image = (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),))

    async def run() -> list[Any]:
        engine.start()
        params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
        try:
            outs = await asyncio.gather(
                *(collect(engine.generate(GenerationRequest(p, params, images=im))) for p, im in (image, text))
            )
        finally:
            await engine.stop()
        return [events[-1].finish for events in outs]

    failed, served = asyncio.run(run())
    assert failed.error is not None and "the vision tower broke" in failed.error
    assert served.error is None and served.generated_tokens == TOKENS, family


async def collect(events: Any) -> list[Any]:
    return [e async for e in events]


def test_the_memory_profile_runs_the_image_encoder(vlm):
    """On CUDA the KV pool is sized after the largest step's peak: a VLM's profile also runs a step with a
    1024 x 1024 image (its encoder and features in the peak). The same step runs here on CPU: the image
    reaches the encoder (its tokens are in the prompt) and the step answers without error."""
    from lmiserve.engine.codecs import image_codec
    from lmiserve.engine.factory import _paged_runner, run_profile_step
    from lmiserve.engine.text.images import probe_prompt

    _, _, loaded = vlm
    codec = image_codec(loaded)
    assert codec is not None
    prompt = probe_prompt(codec)
    assert prompt is not None and prompt.images is not None
    assert prompt.count(image_token_id(loaded.model)) > 0
    encoded: list[int] = []
    original = PagedVisionRunner._encode

    def counted(self, prompt_ids, images):
        encoded.append(len(prompt_ids))
        return original(self, prompt_ids, images)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PagedVisionRunner, "_encode", counted)
        pool = run_profile_step(lambda blocks: _paged_runner(loaded, config(), blocks, None), 64, 16, prompt)
    assert encoded == [len(prompt)] and pool > 0
