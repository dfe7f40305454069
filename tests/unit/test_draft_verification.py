"""The step contract's drafts (`ScheduledTokens.draft_token_ids`, what speculative decoding proposes):
a decode row computes its last token and the drafts in one step, the runner verifies them, and the
request's tokens are exactly those of one token a step: greedy token for token, seeded sampling draw
for draw (each emitted token one draw of the target's own distribution), with drafts all right, all
wrong or mixed, alone and in a batch, on the paged fast runner and on the generic paged runner."""

from __future__ import annotations

import asyncio

import pytest

from helpers.engines import Proposer, running_engine, scratch_blocks
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import AsyncEngine
from lmiserve.engine.core.sequence import Sequence

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Numbers like 1, 2, 3", "naïve café"]
TOKENS = 24


async def run(engine: AsyncEngine, request: GenerationRequest) -> list[StepEvent]:
    return [event async for event in engine.generate(request)]


def tokens_of(events: list[StepEvent]) -> list[int]:
    return [e.token.id for e in events if e.token is not None]


def greedy(max_new_tokens: int = TOKENS, **params) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True, **params)


def sampled(seed: int, **params) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=TOKENS, ignore_eos_token=True, do_sample=True, temperature=1.3, top_k=50, seed=seed, **params
    )


def oracle(reference: dict[tuple[int, ...], list[int]], k: int = 4) -> Proposer:
    """Drafts the reference continuation of the sequence's prompt: every draft right."""

    def propose(seq: Sequence) -> list[int]:
        done = len(seq.output_ids)
        return reference[tuple(seq.prompt_ids)][done : done + k]

    return propose


def wrong(vocab: int, k: int = 3) -> Proposer:
    """Drafts tokens the model never picks here (the last token's neighbours): every draft rejected."""
    return lambda seq: [(seq.output_ids[-1] + 1 + i) % vocab for i in range(k)]


def echo(k: int = 5) -> Proposer:
    """Drafts the prompt's own tokens from where the output would continue it (prompt lookup's idea):
    sometimes right, mostly wrong."""
    return lambda seq: (seq.prompt_ids + seq.output_ids)[-k:]


@pytest.fixture(params=[True, False], ids=["fast", "generic"])
def fast_path(request) -> bool:
    return request.param


async def reference_of(loaded, requests: list[GenerationRequest], fast_path: bool) -> list[list[int]]:
    async with running_engine(loaded, None, fast_path=fast_path) as engine:
        return [tokens_of(await run(engine, r)) for r in requests]


async def test_greedy_drafts_right_wrong_or_mixed_give_the_same_tokens(tiny_model, fast_path):
    requests = [GenerationRequest(p, greedy()) for p in PROMPTS]
    expected = await reference_of(tiny_model, requests, fast_path)
    ids = {r.prompt: tiny_model.tokenizer(r.prompt)["input_ids"] for r in requests}
    reference = {tuple(ids[r.prompt]): out for r, out in zip(requests, expected, strict=True)}
    vocab = len(tiny_model.tokenizer)
    for proposer in (oracle(reference), wrong(vocab), echo()):
        async with running_engine(tiny_model, proposer, fast_path=fast_path) as engine:
            steps_before = engine.steps
            alone = [tokens_of(await run(engine, r)) for r in requests]
            steps_alone = engine.steps - steps_before
            together = [tokens_of(e) for e in await asyncio.gather(*(run(engine, r) for r in requests))]
        assert alone == expected and together == expected
        if proposer.__qualname__.startswith("oracle"):
            # four drafts a step, all accepted: five tokens a step after the prompt's
            assert steps_alone <= len(requests) * (2 + TOKENS // 5)


async def test_seeded_sampling_draws_the_same_tokens_with_drafts(tiny_model, fast_path):
    requests = [GenerationRequest(p, sampled(seed=11 + i)) for i, p in enumerate(PROMPTS)]
    expected = await reference_of(tiny_model, requests, fast_path)
    ids = {r.prompt: tiny_model.tokenizer(r.prompt)["input_ids"] for r in requests}
    reference = {tuple(ids[r.prompt]): out for r, out in zip(requests, expected, strict=True)}
    for proposer in (oracle(reference, k=3), echo(4), wrong(len(tiny_model.tokenizer))):
        async with running_engine(tiny_model, proposer, fast_path=fast_path) as engine:
            together = [tokens_of(e) for e in await asyncio.gather(*(run(engine, r) for r in requests))]
        assert together == expected


async def test_drafts_keep_max_new_tokens_eos_logprobs_and_penalties(tiny_model):
    vocab = len(tiny_model.tokenizer)
    cases = [
        greedy(max_new_tokens=7),
        SamplingParams(max_new_tokens=40, do_sample=False),  # may end at EOS inside a step's drafts
        greedy(top_n_tokens=3),
        greedy(repetition_penalty=1.5, presence_penalty=0.7),
    ]
    requests = [GenerationRequest(PROMPTS[i % len(PROMPTS)], params) for i, params in enumerate(cases)]
    async with running_engine(tiny_model, None) as engine:
        expected = [await run(engine, r) for r in requests]
    for proposer in (echo(6), wrong(vocab, 6)):
        async with running_engine(tiny_model, proposer) as engine:
            got = await asyncio.gather(*(run(engine, r) for r in requests))
        for want, have in zip(expected, got, strict=True):
            assert tokens_of(have) == tokens_of(want)
            assert [e.finish.reason for e in have if e.finish] == [e.finish.reason for e in want if e.finish]
            for a, b in zip([e.token for e in have if e.token], [e.token for e in want if e.token], strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            tops = [[t.id for t in e.top_tokens or ()] for e in have if e.token]
            assert tops == [[t.id for t in e.top_tokens or ()] for e in want if e.token]
    assert len(tokens_of(got[0])) == 7 and got[0][-1].finish.reason is FinishReason.LENGTH


async def test_a_grammar_row_gets_no_drafts_and_keeps_its_mask_beside_drafted_rows(tiny_model):
    from lmiserve.core.grammar import Grammar

    plain = GenerationRequest(PROMPTS[1], greedy())
    async with running_engine(tiny_model, None) as engine:
        expected = tokens_of(await run(engine, plain))
    asked: list[int] = []

    def proposer(seq: Sequence) -> list[int]:
        assert seq.grammar is None
        asked.append(seq.seq_id)
        return (seq.prompt_ids + seq.output_ids)[-3:]

    constrained = GenerationRequest(PROMPTS[0], greedy(max_new_tokens=8, grammar=Grammar("regex", "[ab]{8}")))
    async with running_engine(tiny_model, proposer) as engine:
        # the drafted request first: its row is moved behind the grammar row in the batch
        drafted, events = await asyncio.gather(run(engine, plain), run(engine, constrained))
    text = "".join(e.token.text for e in events if e.token)
    assert len(text) == 8 and set(text) <= {"a", "b"}
    assert tokens_of(drafted) == expected and len(set(asked)) == 1  # drafts asked for the plain request only


async def test_a_full_pool_takes_no_blocks_for_drafts_and_never_preempts_for_them(tiny_model):
    # 4 blocks of 16 tokens for two requests of ~8 prompt tokens + 24 new: the pool runs full, and
    # drafts that would need a block then are dropped rather than preempting anyone. Both engines plan each
    # step after the one before (drafts come from the step before: no overlap scheduling, which a GPU's plain
    # engine would take, and whose planning waits for a free block where this one preempts, drafts or not)
    requests = [GenerationRequest(p, greedy()) for p in PROMPTS[:2]]
    pool = {"kv_cache_memory_bytes": _pool_bytes(tiny_model, 4 + scratch_blocks(tiny_model)), "async_scheduling": False}
    async with running_engine(tiny_model, None, **pool) as engine:
        expected = [tokens_of(e) for e in await asyncio.gather(*(run(engine, r) for r in requests))]
        plain_preemptions = engine.scheduler.num_preemptions
    async with running_engine(tiny_model, echo(8), **pool) as engine:
        got = [tokens_of(e) for e in await asyncio.gather(*(run(engine, r) for r in requests))]
        preemptions = engine.scheduler.num_preemptions
        assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks  # nothing leaked
    assert got == expected
    assert preemptions <= plain_preemptions


def _pool_bytes(loaded, blocks: int) -> int:
    from lmiserve.engine.attention.paged import kv_bytes_per_block

    return blocks * kv_bytes_per_block(loaded.model, 16)
