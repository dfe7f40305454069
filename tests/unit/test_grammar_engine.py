"""Constrained decoding in the engine, on the tiny random model (its own 512-token BPE tokenizer):
masking, EOS only where the grammar is complete, the length cut, rows without a grammar untouched,
compile failures isolated to their request, the compile cache, and every runner strategy."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from test_async_engine import collect, ids_of, make_engine, started

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.text.grammar_compiler import GrammarCompiler
from lmiserve.engine.text.token_mask import TokenMask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2,6}"
# the fast runner, transformers' forward over the blocks, and batch-invariant
RUNNERS = [{}, {"fast_path": False}, {"batch_invariant": True}]


def final(events: list[StepEvent], index: int = 0) -> StepEvent:
    return [e for e in events if e.finish is not None and e.index == index][-1]


def text_of(events: list[StepEvent], index: int = 0) -> str:
    finish = final(events, index).finish
    assert finish is not None
    return finish.generated_text


def constrained(grammar: Grammar, max_new_tokens: int = 80, **params) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, grammar=grammar, **params)


# --- the mask ------------------------------------------------------------------------------------------


def test_mask_allows_exactly_what_the_grammar_allows(tiny_model):
    compiler = GrammarCompiler(tiny_model.tokenizer, vocab_size=len(tiny_model.tokenizer), eos_token_ids=[2])
    matcher = compiler.compile(Grammar("regex", "ab|cd")).matcher()
    vocab = len(tiny_model.tokenizer)
    logits = torch.zeros(1, vocab)
    TokenMask(vocab, [2]).apply(logits, [matcher])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    texts = {tiny_model.tokenizer.decode([i]) for i in allowed}
    assert allowed and all(t in ("a", "ab", "c", "cd") for t in texts)
    assert 2 not in allowed  # nothing matched yet: no EOS


def test_eos_is_allowed_only_where_the_grammar_is_complete(tiny_model):
    tok = tiny_model.tokenizer
    eos = tok.eos_token_id
    compiler = GrammarCompiler(tok, vocab_size=len(tok), eos_token_ids=[eos])
    matcher = compiler.compile(Grammar("regex", "a+")).matcher()
    mask = TokenMask(len(tok), [eos])
    logits = torch.zeros(1, len(tok))
    mask.apply(logits, [matcher])
    assert logits[0, eos] == float("-inf")
    assert matcher.accept(tok.encode("a", add_special_tokens=False)[0])
    logits = torch.zeros(1, len(tok))
    mask.apply(logits, [matcher])
    assert torch.isfinite(logits[0, eos])  # "a" is a whole match; more "a" may follow too
    assert torch.isfinite(logits[0, tok.encode("a", add_special_tokens=False)[0]])


# --- generation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS, ids=["fast", "generic", "batch_invariant"])
async def test_every_runner_generates_what_the_grammar_allows(tiny_model, runner):
    engine = make_engine(tiny_model, max_running=8, **runner)
    schema = Grammar("json_schema", json.dumps(SCHEMA))
    async with started(engine):
        results = await asyncio.gather(
            collect(engine, GenerationRequest("Hello", constrained(schema, 120))),
            collect(engine, GenerationRequest("The quick", constrained(schema, 120, do_sample=True, seed=5))),
            collect(engine, GenerationRequest("Numbers", constrained(Grammar("regex", REGEX)))),
            collect(engine, GenerationRequest("Pick", constrained(Grammar("choice", '["yes", "no"]')))),
        )
    for events in results[:2]:
        assert final(events).finish.reason is FinishReason.EOS_TOKEN
        jsonschema.validate(json.loads(text_of(events)), SCHEMA)
    assert re.fullmatch(REGEX, text_of(results[2]))
    assert text_of(results[3]) in ("yes", "no")


async def test_max_new_tokens_mid_structure_ends_with_length_and_the_partial_text(tiny_model):
    engine = make_engine(tiny_model)
    async with started(engine):
        events = await collect(
            engine, GenerationRequest("Hello", constrained(Grammar("json_schema", json.dumps(SCHEMA)), 4))
        )
    finish = final(events).finish
    assert finish.reason is FinishReason.LENGTH and finish.generated_tokens == 4
    assert finish.generated_text.startswith('{"name":"') or finish.generated_text.startswith('{"')


async def test_rows_without_a_grammar_are_unchanged_by_constrained_neighbours(tiny_model):
    plain_greedy = SamplingParams(max_new_tokens=20)
    plain_seeded = SamplingParams(max_new_tokens=20, do_sample=True, seed=11, temperature=0.8)
    engine = make_engine(tiny_model, max_running=8)
    async with started(engine):
        alone_greedy = await collect(engine, GenerationRequest("Deep learning is", plain_greedy))
        alone_seeded = await collect(engine, GenerationRequest("Once upon", plain_seeded))
        crowd = await asyncio.gather(
            collect(engine, GenerationRequest("Hello", constrained(Grammar("json_schema", json.dumps(SCHEMA))))),
            collect(engine, GenerationRequest("Deep learning is", plain_greedy)),
            collect(engine, GenerationRequest("x", constrained(Grammar("regex", REGEX), do_sample=True, seed=2))),
            collect(engine, GenerationRequest("Once upon", plain_seeded)),
        )
    assert ids_of(crowd[1]) == ids_of(alone_greedy)
    assert ids_of(crowd[3]) == ids_of(alone_seeded)


async def test_seeded_constrained_sampling_is_reproducible_and_each_sequence_has_its_own_matcher(tiny_model):
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    params = constrained(grammar, 120, do_sample=True, seed=3, n=3, best_of=3)
    engine = make_engine(tiny_model)
    async with started(engine):
        first = await collect(engine, GenerationRequest("Hello", params))
        again = await collect(engine, GenerationRequest("Hello", params))
    assert [text_of(first, i) for i in range(3)] == [text_of(again, i) for i in range(3)]
    for i in range(3):
        jsonschema.validate(json.loads(text_of(first, i)), SCHEMA)


@pytest.mark.parametrize(
    "grammar",
    [
        Grammar("regex", "(("),
        Grammar("json_schema", '{"type": "frobnicate"}'),
        Grammar("json_schema", "[1, 2]"),
        Grammar("choice", "[]"),
        Grammar("ebnf", "start: undefined_rule"),
    ],
)
async def test_a_grammar_that_does_not_compile_fails_its_request_alone_before_any_token(tiny_model, grammar):
    engine = make_engine(tiny_model)
    async with started(engine):
        with pytest.raises(InvalidRequest):
            await engine.prepare(GenerationRequest("x", constrained(grammar)))
        bad = GenerationRequest("x", constrained(grammar))
        good = GenerationRequest("Deep learning is", SamplingParams(max_new_tokens=5))
        results = await asyncio.gather(collect(engine, bad), collect(engine, good), return_exceptions=True)
    assert isinstance(results[0], InvalidRequest)
    assert final(results[1]).finish.generated_tokens == 5


async def test_compiled_grammars_are_cached_by_grammar(tiny_model):
    engine = make_engine(tiny_model)
    compiler = engine.grammars
    assert compiler is not None
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    first = await compiler.compile_async(grammar)
    assert compiler.cached(grammar) is first
    assert await compiler.compile_async(Grammar("json_schema", json.dumps(SCHEMA))) is first
    assert compiler.cached(Grammar("regex", REGEX)) is None
    compiler.close()


async def test_compiling_runs_off_the_event_loop_thread(tiny_model, monkeypatch):
    import threading

    engine = make_engine(tiny_model)
    compiler = engine.grammars
    assert compiler is not None
    threads = []
    real = compiler.compile

    def spy(grammar):
        threads.append(threading.current_thread())
        return real(grammar)

    monkeypatch.setattr(compiler, "compile", spy)
    await compiler.compile_async(Grammar("regex", "x+"))
    assert threads and threads[0] is not threading.current_thread()
    compiler.close()


async def test_grammar_that_completes_ends_with_the_eos_finish_reason_without_an_eos_token(tiny_model):
    engine = make_engine(tiny_model)
    async with started(engine):
        events = await collect(engine, GenerationRequest("Pick", constrained(Grammar("choice", '["yes"]'))))
    finish = final(events).finish
    assert finish.reason is FinishReason.EOS_TOKEN and finish.generated_text == "yes"
    assert tiny_model.tokenizer.eos_token_id not in ids_of(events)
