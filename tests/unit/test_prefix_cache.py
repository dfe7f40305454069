"""The prefix cache (the paged KV pool's shared blocks, engine/core/kv_blocks.py) in the engine on the tiny
random Llama, fast and generic runners: greedy tokens identical with the cache and without it (and to
`model.generate`), what it reports, a small pool evicting while staying right, salts never shared.
The pool's hash chain and eviction order as a state machine: tests/unit/test_kv_blocks.py."""

from __future__ import annotations

import asyncio

import pytest

from helpers.engines import running_engine, scratch_blocks
from helpers.greedy import greedy_reference
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.stats import StepStats
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import AsyncEngine

SYSTEM = "The server streams tokens to the client as soon as they are generated. " * 2
QUESTIONS = [
    "What is the capital of France? The capital",
    "Deep learning is a subfield of",
    "Hello world! How are you",
]


# --- the engine ---------------------------------------------------------------------------------------


async def run(engine: AsyncEngine, prompt: str, **params) -> tuple[list[int], int]:
    """The generated ids and the cached prompt tokens reported."""
    params.setdefault("max_new_tokens", 12)
    events = [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(**params)))]
    finish = events[-1].finish
    assert finish is not None
    return [e.token.id for e in events if e.token is not None], finish.cached_tokens


# lmiserve's own forward and transformers' over the same blocks: the pool is the prefix cache (shared full
# blocks, never copied)
RUNNERS = [{"fast_path": True}, {"fast_path": False}]
RUNNER_IDS = ["fast", "generic"]


@pytest.mark.parametrize("runner", RUNNERS, ids=RUNNER_IDS)
async def test_multi_turn_greedy_tokens_are_identical_with_and_without_the_cache(tiny_model, runner):
    """Each turn resends the history and the previous answer: it starts from the blocks stored by the
    turn before (its prompt's and its answer's)."""
    tokenizer = tiny_model.tokenizer

    async def chat(engine: AsyncEngine) -> list[tuple[list[int], int]]:
        messages = [{"role": "system", "content": SYSTEM}]
        results = []
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids, cached = await run(engine, prompt, max_new_tokens=16)
            results.append((ids, cached))
            messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        return results

    async with running_engine(tiny_model, enable_prefix_caching=False, **runner) as engine:
        plain = await chat(engine)
    async with running_engine(tiny_model, **runner) as engine:
        cached = await chat(engine)
    assert [ids for ids, _ in cached] == [ids for ids, _ in plain]
    assert [hits for _, hits in plain] == [0, 0, 0]
    assert cached[0][1] == 0 and cached[1][1] > 16 and cached[2][1] > cached[1][1]
    assert all(hits % 16 == 0 for _, hits in cached)


@pytest.mark.parametrize("runner", RUNNERS, ids=RUNNER_IDS)
async def test_partial_and_full_matches_give_the_tokens_of_a_fresh_engine(tiny_model, runner, reference_ids):
    base = SYSTEM + QUESTIONS[0]
    while len(tiny_model.tokenizer(base)["input_ids"]) % 4:  # whole blocks, so the prompt can be all cached
        base = base[:-1]
    prompts = [
        base,
        base,  # fully cached: the last block is partly computed again
        base[:-9] + "Berlin is a city",  # diverges inside a block, near the end
        SYSTEM[:40] + "Numbers like 1, 2, 3",  # diverges early
        base + " and more",  # extends the first
    ]
    async with running_engine(tiny_model, block_size=4, **runner) as engine:
        results = [await run(engine, p) for p in prompts]
    for prompt, (ids, _) in zip(prompts, results, strict=True):
        assert ids == reference_ids(prompt, 12), prompt
    lengths = [len(tiny_model.tokenizer(p)["input_ids"]) for p in prompts]
    assert results[0][1] == 0
    # full blocks only, one token left to compute: the whole last block is computed again
    assert results[1][1] == lengths[1] - 4
    assert 0 < results[2][1] < lengths[2] - 1 and results[2][1] % 4 == 0
    assert results[4][1] >= (lengths[0] // 4) * 4


@pytest.mark.parametrize("runner", RUNNERS, ids=RUNNER_IDS)
async def test_a_small_pool_evicts_keeps_memory_bounded_and_tokens_right(tiny_model, runner, reference_ids):
    """A pool of 16 blocks of 4 tokens holds one request (~55 tokens) and little more: each new prompt
    evicts the least recently used cached blocks of the earlier ones (their tails first, the shared
    system prompt's head staying), and every answer is still generate's."""
    blocks, per_block = 16, kv_bytes_per_block(tiny_model.model, 4)
    prompts = [SYSTEM + q for q in QUESTIONS] * 3
    async with running_engine(tiny_model, block_size=4, **runner) as engine:  # a pool that keeps everything
        roomy = [(await run(engine, p))[1] for p in prompts]
    budget = per_block * (blocks + scratch_blocks(tiny_model, runner["fast_path"]))  # (and the graphs' block)
    async with running_engine(tiny_model, block_size=4, kv_cache_memory_bytes=budget, **runner) as engine:
        assert engine.pool.num_blocks == engine.runner.num_blocks == blocks
        hits = []
        for prompt in prompts:
            ids, cached = await run(engine, prompt)
            assert ids == reference_ids(prompt, 12)
            hits.append(cached)
            assert engine.pool.num_cached_blocks <= blocks
        snap = engine.snapshot()
        assert engine.pool.num_used_blocks == 0  # every request ended: its blocks are free (cached or not)
    assert snap.prefix_cache_capacity == blocks * 4 and 0 < snap.prefix_cache_tokens <= blocks * 4
    assert snap.prefix_cache_bytes == engine.runner.kv_bytes
    assert all(h >= 32 for h in hits[1:])  # the system prompt's 8 full blocks, shared by every prompt
    assert all(h <= r for h, r in zip(hits, roomy, strict=True))
    assert hits[3:] != roomy[3:]  # a repeated prompt lost its tail blocks to the ones after it


@pytest.mark.parametrize("runner", RUNNERS, ids=RUNNER_IDS)
async def test_concurrent_requests_sharing_a_prefix(tiny_model, runner, reference_ids):
    prompts = [SYSTEM + q for q in QUESTIONS * 2]
    steps: list[StepStats] = []

    class Steps:
        def on_step(self, step: StepStats) -> None:
            steps.append(step)

        def on_rejected(self, error: BaseException) -> None: ...
        def on_submitted(self, prompt_tokens: int, sequences: int) -> None: ...
        def on_finished(self, request: object) -> None: ...

    async with running_engine(tiny_model, max_running=4, max_prefill_tokens=24, **runner) as engine:
        engine.add_observer(Steps())  # type: ignore[arg-type]
        await run(engine, prompts[0])  # the shared system prompt is cached
        results = await asyncio.gather(*(run(engine, p, max_new_tokens=10) for p in prompts))
    for prompt, (ids, cached) in zip(prompts, results, strict=True):
        assert ids == reference_ids(prompt, 10)
        assert cached >= 16
    assert sum(s.prefix_hit_tokens for s in steps) == sum(c for _, c in results)
    assert sum(s.prefix_queried_tokens for s in steps) > sum(c for _, c in results)


async def test_seeded_sampling_is_unchanged_by_the_cache(tiny_model):
    params = dict(do_sample=True, seed=4321, temperature=0.9, top_k=50, max_new_tokens=16)
    prompt = SYSTEM + QUESTIONS[1]
    async with running_engine(tiny_model, enable_prefix_caching=False) as engine:
        plain = await run(engine, prompt, **params)
    async with running_engine(tiny_model) as engine:
        first = await run(engine, prompt, **params)
        again = await run(engine, prompt, **params)
    assert again[1] > 0
    assert plain[0] == first[0] == again[0]


async def test_prompt_logprobs_requests_do_not_use_the_cache(tiny_model):
    async with running_engine(tiny_model) as engine:
        await run(engine, SYSTEM)
        events = [
            e
            async for e in engine.generate(
                GenerationRequest(SYSTEM, SamplingParams(max_new_tokens=2, decoder_input_details=True))
            )
        ]
    finish = events[-1].finish
    assert finish is not None and finish.cached_tokens == 0
    assert finish.prefill is not None and len(finish.prefill) == finish.prompt_tokens


async def test_batch_invariant_has_no_prefix_cache(tiny_model):
    """Blocks computed in another step's shapes round differently: a batch-invariant engine shares none."""
    async with running_engine(tiny_model, batch_invariant=True) as engine:
        assert engine.runner.path == "batch_invariant" and not engine.pool.enable_prefix_caching
        assert engine.snapshot().prefix_cache_capacity == 0
        assert [(await run(engine, SYSTEM))[1] for _ in range(2)] == [0, 0]


@pytest.fixture(scope="module")
def reference_ids(tiny_model):
    """Greedy ids of a prompt from `model.generate` (cut after the first EOS)."""
    generate = greedy_reference(tiny_model)
    return lambda prompt, max_new_tokens: generate(tiny_model.tokenizer(prompt)["input_ids"], max_new_tokens)


async def test_salted_requests_share_blocks_with_the_same_salt_only(tiny_model, reference_ids):
    """A block's hash chain starts from the request's `cache_salt`: requests share cached blocks only
    with requests of the same salt (unsalted ones among themselves), and the tokens never change."""
    prompt = SYSTEM + QUESTIONS[0]

    async def cached_tokens(engine: AsyncEngine, salt: str | None) -> int:
        request = GenerationRequest(prompt, SamplingParams(max_new_tokens=4), cache_salt=salt)
        events = [e async for e in engine.generate(request)]
        assert [e.token.id for e in events if e.token is not None] == reference_ids(prompt, 4)
        assert events[-1].finish is not None
        return events[-1].finish.cached_tokens

    async with running_engine(tiny_model) as engine:
        assert await cached_tokens(engine, "tenant-a") == 0
        assert await cached_tokens(engine, "tenant-a") > 0
        assert await cached_tokens(engine, None) == 0
        assert await cached_tokens(engine, None) > 0
        assert await cached_tokens(engine, "tenant-b") == 0


def test_prefix_cache_size_is_named_at_start_up(caplog):
    """It sized the slot cache's prefix cache (gone): set, the start-up log says it is ignored; the pool is the cache."""
    from lmiserve.config import Settings
    from lmiserve.models.compose import engine_config

    with caplog.at_level("WARNING", logger="lmiserve.models.compose"):
        engine_config(Settings.from_options({"prefix_cache_size": "1MiB"}))
        engine_config(Settings.from_options({}))
    assert [r.message.split(":")[0] for r in caplog.records] == ["prefix_cache_size is ignored"]
