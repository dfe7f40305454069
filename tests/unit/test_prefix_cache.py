"""The prefix cache: its index (exact chain keys, LRU, at least one token left to compute), and the
engine with it on the tiny random Llama, fast and generic runners: greedy tokens identical with the
cache and without it (and to `model.generate`), what it reports, bounded memory under eviction."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from helpers.greedy import greedy_reference
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.stats import StepStats
from lmiserve.engine.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.prefix_cache import PrefixIndex
from lmiserve.engine.prefix_store import bytes_per_token

SYSTEM = "The server streams tokens to the client as soon as they are generated. " * 2
QUESTIONS = [
    "What is the capital of France? The capital",
    "Deep learning is a subfield of",
    "Hello world! How are you",
]


# --- the index ----------------------------------------------------------------------------------------


def test_a_prompt_finds_the_blocks_of_its_head_and_always_leaves_a_token_to_compute():
    index = PrefixIndex(num_blocks=8, block_size=4)
    tokens = list(range(100, 110))  # two full blocks and two tokens
    assert index.match(tokens).tokens == 0
    new = index.store(tokens)
    assert [number for number, _ in new] == [0, 1] and index.used_blocks == 2
    assert index.store(tokens) == []  # nothing new
    assert index.match(tokens).tokens == 8
    assert index.match(tokens[:8]).tokens == 7  # fully cached: the last token is computed again
    assert index.match(tokens[:8]).blocks == tuple(i for _, i in new)
    assert index.match(tokens[:5]).tokens == 4
    assert index.match([*tokens[:6], 999, 998, 997]).tokens == 4  # diverges inside block 1
    assert index.match([999, *tokens[1:]]).tokens == 0  # same block 1 after another block 0: no match


def test_least_recently_used_blocks_go_first_leaves_before_their_root():
    index = PrefixIndex(num_blocks=4, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    index.store(a)
    index.store(b)
    index.match(a)  # a is now the most recently used
    index.store([9, 10])  # evicts b's leaf
    assert index.match(b).tokens == 2 and index.match(a).tokens == 3
    index.store([11, 12, 13, 14])  # two blocks: evicts what is least recent, never its own chain
    assert index.used_blocks == 4
    assert index.match([11, 12, 13, 14, 0]).tokens == 4


# --- the engine ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def engine_for(loaded, **config):
    engine = create_engine(loaded, EngineConfig(**config))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def run(engine: AsyncEngine, prompt: str, **params) -> tuple[list[int], int]:
    """The generated ids and the cached prompt tokens reported."""
    params.setdefault("max_new_tokens", 12)
    events = [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(**params)))]
    finish = events[-1].finish
    assert finish is not None
    return [e.token.id for e in events if e.token is not None], finish.cached_tokens


# the slot cache's prefix cache (a pool of copied blocks) on both runners, and the paged KV cache, where
# the pool is the prefix cache (shared full blocks, never copied)
RUNNERS = [
    {"fast_path": True, "kv_cache": "slots"},
    {"fast_path": False, "kv_cache": "slots"},
    {"fast_path": True, "kv_cache": "paged"},
    {"fast_path": False, "kv_cache": "paged"},  # transformers' forward over the blocks
]
RUNNER_IDS = ["fast", "generic", "paged", "paged-generic"]


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

    async with engine_for(tiny_model, prefix_cache_bytes=0, **runner) as engine:
        plain = await chat(engine)
    async with engine_for(tiny_model, **runner) as engine:
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
    async with engine_for(tiny_model, prefix_block_size=4, block_size=4, **runner) as engine:
        results = [await run(engine, p) for p in prompts]
    for prompt, (ids, _) in zip(prompts, results, strict=True):
        assert ids == reference_ids(prompt, 12), prompt
    lengths = [len(tiny_model.tokenizer(p)["input_ids"]) for p in prompts]
    assert results[0][1] == 0
    # everything but the last token (paged: full blocks only, so the whole last block is computed again)
    assert results[1][1] == lengths[1] - (4 if runner.get("kv_cache") == "paged" else 1)
    assert 0 < results[2][1] < lengths[2] - 1 and results[2][1] % 4 == 0
    assert results[4][1] >= (lengths[0] // 4) * 4


async def test_a_tiny_budget_evicts_keeps_memory_bounded_and_tokens_right(tiny_model, reference_ids):
    engine = create_engine(tiny_model, EngineConfig(prefix_cache_bytes=1, prefix_block_size=4, kv_cache="slots"))
    assert engine.prefix is None and engine.snapshot().prefix_cache_capacity == 0  # not one block fits: off
    per_block = bytes_per_token(engine.runner.cache) * 4
    prompts = [SYSTEM + q for q in QUESTIONS] * 3
    async with engine_for(
        tiny_model, prefix_cache_bytes=per_block * 6, prefix_block_size=4, kv_cache="slots"
    ) as engine:
        assert engine.prefix is not None and engine.prefix.num_blocks == 6
        store = engine.runner.prefix_store
        assert store is not None and store.nbytes <= per_block * 6
        hits = []
        for prompt in prompts:
            ids, cached = await run(engine, prompt)
            assert ids == reference_ids(prompt, 12)
            hits.append(cached)
            assert engine.prefix.used_blocks <= 6
        snap = engine.snapshot()
    assert snap.prefix_cache_capacity == 24 and snap.prefix_cache_tokens == 24 and snap.prefix_cache_usage == 1.0
    assert snap.prefix_cache_bytes == store.nbytes
    assert any(hits) and max(hits) <= 24


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

    async with engine_for(tiny_model, max_running=4, max_prefill_tokens=24, **runner) as engine:
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
    async with engine_for(tiny_model, prefix_cache_bytes=0) as engine:
        plain = await run(engine, prompt, **params)
    async with engine_for(tiny_model) as engine:
        first = await run(engine, prompt, **params)
        again = await run(engine, prompt, **params)
    assert again[1] > 0
    assert plain[0] == first[0] == again[0]


async def test_prompt_logprobs_requests_do_not_use_the_cache(tiny_model):
    async with engine_for(tiny_model) as engine:
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


def test_batch_invariant_has_no_prefix_cache(tiny_model):
    engine = create_engine(tiny_model, EngineConfig(batch_invariant=True))
    assert engine.prefix is None and engine.snapshot().prefix_cache_capacity == 0


@pytest.fixture(scope="module")
def reference_ids(tiny_model):
    """Greedy ids of a prompt from `model.generate` (cut after the first EOS)."""
    generate = greedy_reference(tiny_model)
    return lambda prompt, max_new_tokens: generate(tiny_model.tokenizer(prompt)["input_ids"], max_new_tokens)


async def test_a_failing_copy_into_the_cache_drops_it_and_no_answer_changes(tiny_model, reference_ids, monkeypatch):
    from lmiserve.engine.prefix_store import PrefixStore

    real_save, calls = PrefixStore.save, []

    def failing_once(self, slot, blocks):
        calls.append(slot)
        if len(calls) == 1:
            raise RuntimeError("copy failed")
        real_save(self, slot, blocks)

    monkeypatch.setattr(PrefixStore, "save", failing_once)
    prompt = SYSTEM + QUESTIONS[2]
    async with engine_for(tiny_model, kv_cache="slots") as engine:
        first = await run(engine, prompt)
        assert engine.prefix is not None and engine.prefix.used_blocks > 0  # stored again when it left
        second = await run(engine, prompt)
    assert first[0] == second[0] == reference_ids(prompt, 12)
    assert first[1] == 0 and second[1] > 0 and len(calls) >= 2


async def test_the_slot_cache_never_shares_a_salted_requests_blocks(tiny_model):
    """The slot cache keys blocks by tokens alone: a request with a `cache_salt` neither uses nor fills
    it (sharing nothing is the only way to honour a salt there); unsalted requests still share."""
    prompt = SYSTEM + QUESTIONS[0]

    async def cached_tokens(engine: AsyncEngine, salt: str | None) -> int:
        request = GenerationRequest(prompt, SamplingParams(max_new_tokens=4), cache_salt=salt)
        events = [e async for e in engine.generate(request)]
        assert events[-1].finish is not None
        return events[-1].finish.cached_tokens

    async with engine_for(tiny_model, kv_cache="slots") as engine:
        assert [await cached_tokens(engine, "tenant-a") for _ in range(2)] == [0, 0]
        assert await cached_tokens(engine, None) == 0
        assert await cached_tokens(engine, None) > 0
        assert await cached_tokens(engine, "tenant-a") == 0


def test_prefix_cache_size_with_the_paged_cache_is_named_at_start_up(caplog):
    """It sizes the slot cache's prefix cache only: set with kv_cache=paged, the start-up log says so."""
    from lmiserve.config import Settings
    from lmiserve.models.compose import engine_config

    with caplog.at_level("WARNING", logger="lmiserve.models.compose"):
        engine_config(Settings.from_options({"prefix_cache_size": "1MiB"}))
        engine_config(Settings.from_options({"prefix_cache_size": "1MiB", "kv_cache": "slots"}))
        engine_config(Settings.from_options({}))
    assert [r.message.split(":")[0] for r in caplog.records] == [
        "prefix_cache_size sizes the slot cache's prefix cache only"
    ]
