"""The prefix cache on the real bundled model (SmolLM2-135M-Instruct): a multi-turn chat whose every
turn resends the history gives the same greedy tokens with ``enable_prefix_caching=true`` and
``false``, and the later turns start from the blocks the earlier ones left (their prompts and answers).
The engines are built from settings, as the server builds them."""

from __future__ import annotations

import pytest

from lmiserve.config import Settings
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import AsyncEngine
from lmiserve.models.compose import build_engine

pytestmark = pytest.mark.e2e

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences, plainly and accurately."
QUESTIONS = [
    "What is the capital of France?",
    "And how many people live there?",
    "Name one famous museum in that city.",
    "Why is it famous?",
]


async def conversation(engine: AsyncEngine, tokenizer) -> list[tuple[list[int], int, int]]:
    """Per turn: the answer's token ids, the prompt tokens and the cached prompt tokens."""
    engine.start()
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    try:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            params = SamplingParams(max_new_tokens=32)
            events = [e async for e in engine.generate(GenerationRequest(prompt, params))]
            finish = events[-1].finish
            assert finish is not None
            ids = [e.token.id for e in events if e.token is not None]
            turns.append((ids, finish.prompt_tokens, finish.cached_tokens))
            messages.append({"role": "assistant", "content": finish.generated_text})
    finally:
        await engine.stop()
    return turns


async def test_multi_turn_chat_gives_the_same_tokens_with_and_without_the_prefix_cache(smollm_model):
    """The pool's shared blocks are the cache."""
    tokenizer = smollm_model.tokenizer
    on = build_engine(smollm_model, Settings.from_options({}))
    off = build_engine(smollm_model, Settings.from_options({"enable_prefix_caching": "false"}))
    assert on.pool.enable_prefix_caching and not off.pool.enable_prefix_caching
    cached = await conversation(on, tokenizer)
    plain = await conversation(off, tokenizer)
    assert [ids for ids, _, _ in cached] == [ids for ids, _, _ in plain]
    assert all(hits == 0 for _, _, hits in plain)
    assert cached[0][2] == 0
    for (_, prompt, hits), (_, previous_prompt, _) in zip(cached[1:], cached[:-1], strict=True):
        assert hits >= (previous_prompt // 16) * 16 and hits < prompt  # at least the previous prompt's blocks
    text = tokenizer.decode(cached[0][0], skip_special_tokens=True)
    assert "Paris" in text
