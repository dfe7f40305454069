"""The thinking budget in the engine (engine/text/thinking.py, `SamplingParams.thinking`), on the tiny random
model whose chat template opens `<think>` (`thinking_model_dir`): after exactly N tokens inside the block
the closing tokens are forced and the answer follows; budget 0 closes a block the template opened at
once; a block the model opens itself is counted from its start marker; a multi-token closing text is
forced whole; a grammar waiting for the block's end applies after the forced end; every KV layout, a
batch of different budgets, chunked prefill and speculative decoding (drafts capped at the budget) give
the same tokens. The protocols' side: tests/unit/test_reasoning_presets.py."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from helpers.engines import running_engine
from helpers.tiny_model import THINK_END, THINK_START
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest, SamplingParams, ThinkingBudget
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.speculative.proposers import SpeculationSettings
from lmiserve.engine.text.thinking import BudgetTracker, ForcedTokens
from lmiserve.engine.text.token_mask import TokenMask
from lmiserve.models.load import LoadedModel, load_causal_lm
from lmiserve.protocols.textgen.reasoning import Markers, Reasoning

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_model(thinking_model_dir) -> LoadedModel:
    # the device tests/conftest.py's `tiny_model` uses (a module named `conftest` may be another tier's)
    return load_causal_lm(thinking_model_dir, dtype="fp32", device=os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def prompt(thinking_model) -> str:
    text = thinking_model.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert text.endswith(THINK_START + "\n")  # the template opened the block
    return text


@pytest.fixture(scope="module")
def ids(thinking_model) -> tuple[int, int]:
    tok = thinking_model.tokenizer
    return tok.convert_tokens_to_ids(THINK_START), tok.convert_tokens_to_ids(THINK_END)


def budget(tokens: int, *, inside: bool = True, close: str = THINK_END) -> ThinkingBudget:
    return ThinkingBudget(tokens=tokens, close=close, ends=(THINK_END,), starts=(THINK_START,), inside=inside)


def params(tokens: int | None, max_new_tokens: int = 24, **kw) -> SamplingParams:
    """Greedy, `max_new_tokens` whatever EOS; a budget of `tokens` (None: none) unless `thinking` is given."""
    kw.setdefault("thinking", budget(tokens) if tokens is not None else None)
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True, **kw)


async def generated(engine, request: GenerationRequest) -> tuple[list[int], str]:
    events = [e async for e in engine.generate(request)]
    finish = events[-1].finish
    assert finish is not None and finish.error is None, finish
    return [e.token.id for e in events if e.token is not None], finish.generated_text


# --- the pieces ----------------------------------------------------------------------------------------


def test_forced_tokens_mask_allows_only_the_next_one_and_never_eos(thinking_model, ids):
    _, end = ids
    vocab = len(thinking_model.tokenizer)
    forced = ForcedTokens([end, 7])
    mask = TokenMask(vocab, [thinking_model.tokenizer.eos_token_id])
    import torch

    logits = torch.zeros(1, vocab)
    mask.apply(logits, [forced])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [end]
    assert not forced.accept(7) and forced.accept(end) and not forced.done
    logits = torch.zeros(1, vocab)
    mask.apply(logits, [forced])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [7]
    assert forced.accept(7) and forced.done


def test_the_tracker_counts_as_the_reasoning_parser_does(thinking_model, ids):
    tok = thinking_model.tokenizer
    start, end = ids
    word = tok.encode(" Paris", add_special_tokens=False)
    spec = budget(100, inside=False)
    tracker = BudgetTracker(spec, _hf(tok), [])
    output = [tok.encode(" ", add_special_tokens=False)[0], start, *word, *word, end, *word]
    for token in output[: -len(word) - 1]:
        tracker.feed(token)
    assert tracker.open and tracker.used == 2 * len(word)
    for token in output[-len(word) - 1 :]:
        tracker.feed(token)
    assert not tracker.open and tracker.used == 2 * len(word) + 1  # closed by the model, its end counted
    parser = Reasoning(Markers(THINK_START, THINK_END), inside=False)
    assert parser.tokens(tok.decode([t]) for t in output) == tracker.used
    # the output starts with text: no block, the budget never applies
    other = BudgetTracker(spec, _hf(tok), [])
    other.feed(word[0])
    assert not other.open


def _hf(tokenizer):
    from lmiserve.engine.text.tokenizer import HfTokenizer

    return HfTokenizer(tokenizer)


# --- the engine ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", [{}, {"batch_invariant": True}], ids=["batched", "batch_invariant"])
@pytest.mark.parametrize("tokens", [0, 1, 5])
async def test_the_end_is_forced_after_exactly_n_thinking_tokens_then_the_answer_follows(
    thinking_model, prompt, ids, runner, tokens
):
    _, end = ids
    async with running_engine(thinking_model, **runner) as engine:
        free, _ = await generated(engine, GenerationRequest(prompt, params(None)))
        out, text = await generated(engine, GenerationRequest(prompt, params(tokens)))
    assert end not in free[:tokens]  # the random model does not close the block by itself
    assert out[:tokens] == free[:tokens]  # free thinking until the budget is spent
    assert out[tokens] == end and len(out) == 24
    reasoning, content = Reasoning(Markers(THINK_START, THINK_END), inside=True).split(text)
    assert content  # the answer followed (the random model may write anything, `</think>` too)
    parser = Reasoning(Markers(THINK_START, THINK_END), inside=True)
    assert parser.tokens(thinking_model.tokenizer.decode([t]) for t in out) == tokens + 1  # with the end
    assert reasoning == thinking_model.tokenizer.decode(out[:tokens])


async def test_a_block_the_model_opens_is_counted_from_its_start_marker(thinking_model, ids):
    start, end = ids
    plain = thinking_model.tokenizer.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    # pushed to open a block: every free token is `<think>`; the first opens it, two more are counted
    request = GenerationRequest(plain, params(2, logit_bias={start: 100.0}, thinking=budget(2, inside=False)))
    async with running_engine(thinking_model) as engine:
        out, _ = await generated(engine, request)
    assert out[:4] == [start, start, start, end]
    assert out[4] == start  # the answer: the bias still pushes `<think>`, as text now


async def test_a_closing_text_of_several_tokens_is_forced_whole(thinking_model, prompt):
    close = THINK_END + "\n\nAnswer:"
    closing = thinking_model.tokenizer.encode(close, add_special_tokens=False)
    assert len(closing) > 2
    async with running_engine(thinking_model) as engine:
        out, text = await generated(engine, GenerationRequest(prompt, params(3, thinking=budget(3, close=close))))
    assert out[3 : 3 + len(closing)] == closing
    assert "</think>\n\nAnswer:" in text


async def test_a_grammar_after_the_block_applies_after_the_forced_end(thinking_model, prompt, ids):
    _, end = ids
    grammar = Grammar("regex", "[0-9]{4}", after=THINK_END)
    request = GenerationRequest(prompt, SamplingParams(max_new_tokens=40, grammar=grammar, thinking=budget(4)))
    async with running_engine(thinking_model) as engine:
        out, text = await generated(engine, request)
    assert out[4] == end
    _, answer = text.split(THINK_END, 1)
    assert re.fullmatch(r"[ \t\r\n]*[0-9]{4}", answer), answer


async def test_a_batch_of_budgets_with_chunked_prefill_and_n(thinking_model, prompt, ids):
    _, end = ids
    budgets = [0, 2, 7, 3]
    async with running_engine(thinking_model, max_prefill_tokens=8, prefill_floor=None) as engine:
        results = await asyncio.gather(
            *(generated(engine, GenerationRequest(prompt, params(n, max_new_tokens=16))) for n in budgets)
        )
        sampled = [
            e
            async for e in engine.generate(
                GenerationRequest(prompt, params(4, do_sample=True, seed=3, n=3, best_of=3, max_new_tokens=12))
            )
        ]
    for n, (out, _) in zip(budgets, results, strict=True):
        assert out[n] == end and end not in out[:n]
    for index in range(3):
        out = [e.token.id for e in sampled if e.token is not None and e.index == index]
        assert out[4] == end


async def test_speculative_decoding_caps_its_drafts_at_the_budget(thinking_model, prompt, ids):
    _, end = ids
    requests = [GenerationRequest(prompt, params(n, max_new_tokens=32)) for n in (0, 1, 3, 6, 11)]
    async with running_engine(thinking_model) as engine:
        expected = [await generated(engine, r) for r in requests]
    spec = SpeculationSettings("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, min_acceptance_rate=0.0)
    async with running_engine(thinking_model, speculation=spec) as engine:
        alone = [await generated(engine, r) for r in requests]
        together = await asyncio.gather(*(generated(engine, r) for r in requests))
        info = engine.snapshot().speculation
    assert alone == expected and list(together) == expected
    assert info is not None and info["num_drafts"] > 0
    for n, (out, _) in zip((0, 1, 3, 6, 11), expected, strict=True):
        assert out[n] == end


async def test_drafts_that_would_think_past_the_budget_are_cut_at_it(thinking_model, prompt, ids):
    """Drafts of the model's unbounded thinking, every one right: a step verifies only as many as the
    budget has left, so the block still ends after exactly N tokens."""
    from lmiserve.engine.core.block_scheduler import BlockScheduler

    _, end = ids
    budgets = (0, 1, 4, 9)
    async with running_engine(thinking_model) as engine:
        free, _ = await generated(engine, GenerationRequest(prompt, params(None, max_new_tokens=32)))
        expected = [await generated(engine, GenerationRequest(prompt, params(n, max_new_tokens=32))) for n in budgets]
    assert end not in free[:9]

    def propose(seq) -> list[int]:  # the unbounded continuation until the block is closed, then the bounded one
        done = len(seq.output_ids)
        reference = free if end not in seq.output_ids else expected[budgets.index(seq.params.thinking.tokens)][0]
        return reference[done : done + 4]

    engine = create_engine(thinking_model, EngineConfig(speculation=SpeculationSettings("ngram", 4)))
    assert isinstance(engine.scheduler, BlockScheduler)
    engine.scheduler.proposer = propose
    engine.start()
    try:
        steps = engine.steps
        got = [await generated(engine, GenerationRequest(prompt, params(n, max_new_tokens=32))) for n in budgets]
        steps = engine.steps - steps
    finally:
        await engine.stop()
    assert got == expected
    assert steps < len(budgets) * 32 / 2  # drafts were verified and kept
