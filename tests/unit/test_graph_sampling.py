"""A decode graph's sampled rows (engine/runner/graph_sampling.py, engine/attention/cuda_graphs.py): the
graph's pick is the eager GPU sampler's, row for row, and an engine whose decode graphs sample gives the
tokens of one whose steps sample eagerly. On a CPU the graphs' step runs from the same buffers without a
capture and the draw kernel under Triton's interpreter (tests/conftest.py); the sampler is made to take
the GPU's path there (`_at_once`, `usable`). The GPU check's engine tests run this file compiled."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re

import pytest
import torch

from helpers.capture_hazards import Hazards, watch
from helpers.decode_graphs import graphs_on_the_test_device
from helpers.llama_variants import PROMPTS
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.core.step import StepOutput
from lmiserve.engine.factory import create_engine
from lmiserve.engine.runner import eager_sampling, graph_sampling, sampling
from lmiserve.engine.runner.graph_sampling import (
    FILTERED,
    GRAPH_TOP_K,
    GRAPH_TOP_N,
    SAMPLED,
    GraphSampler,
    in_graph,
    kind,
)
from lmiserve.engine.runner.in_flight import StepsInFlight
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
from lmiserve.engine.runner.sampling import UNDRAWABLE, sample_rows, sampler_row

pytest.importorskip("triton")

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))

OPTIONS = [
    {},  # greedy
    {"do_sample": True},
    {"do_sample": True, "temperature": 0.7},
    {"do_sample": True, "top_k": 5},
    {"do_sample": True, "top_p": 0.9},
    {"do_sample": True, "min_p": 0.1, "temperature": 1.3},
    {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02},
    {"do_sample": True, "top_k": 100_000},  # past the vocabulary: no top_k
]


def test_which_rows_a_graph_samples(monkeypatch):
    assert in_graph(SamplingParams())
    assert all(in_graph(SamplingParams(**o)) for o in OPTIONS[1:7])
    assert in_graph(SamplingParams(do_sample=True, top_k=GRAPH_TOP_K))
    assert in_graph(SamplingParams(top_n_tokens=2)) and in_graph(
        SamplingParams(do_sample=True, top_n_tokens=GRAPH_TOP_N)
    )
    penalized = [
        {"repetition_penalty": 1.1},
        {"frequency_penalty": 0.5, "top_n_tokens": 2},
        {"do_sample": True, "presence_penalty": 0.5, "top_p": 0.9},
        {"do_sample": True, "frequency_penalty": 0.5},
    ]
    assert all(in_graph(SamplingParams(**o)) for o in penalized)
    banning = [
        {"min_new_tokens": 3},
        {"repetition_penalty": 1.1, "min_new_tokens": 3},
        {"do_sample": True, "min_new_tokens": 3},
    ]
    assert all(in_graph(SamplingParams(**o), banned=2) for o in banning)  # (tests/unit/test_graph_bans.py)
    refused = [
        {"top_n_tokens": GRAPH_TOP_N + 1},
        {"repetition_penalty": 1.1, "top_n_tokens": GRAPH_TOP_N + 1},
        {"do_sample": True, "logit_bias": {3: 1.0}},
        {"do_sample": True, "bad_words_ids": [[5]]},
        {"do_sample": True, "typical_p": 0.9},
        {"do_sample": True, "top_k": GRAPH_TOP_K + 1},
    ]
    assert not any(in_graph(SamplingParams(**o)) for o in refused)
    monkeypatch.setattr(graph_sampling, "PENALTIES_IN_GRAPHS", False)
    assert not any(in_graph(SamplingParams(**o)) for o in penalized)


def _logits(rows: int, vocab: int = 700) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3
    if rows > 2:  # a row with tokens removed, one with a NaN
        logits[1, 10:20] = float("-inf")
        logits[2, 5] = float("nan")
    return logits.to(DEVICE)


def test_a_graphs_pick_is_the_eager_samplers_row_for_row(gpu_sampler):
    """Every kind of row the graph samples, at several token indexes, padded to a larger graph: each row's
    token and logprob are `sample_rows`'s (the GPU's path: warped at once, drawn by the kernel), bit for
    bit, and those of the row sampled alone; the pick reads nothing on the host."""
    rows, size = len(OPTIONS), 16
    logits = _logits(size)
    counts = [0, 3, 7, 1, 250, 9, 12, 4]
    seeds = [100 + j for j in range(rows)]
    params = [SamplingParams(**o) for o in OPTIONS]
    sampler = GraphSampler(size, logits.shape[-1], DEVICE, pin=False)
    sampler.fill([(p, s, n, None, ()) for p, s, n in zip(params, seeds, counts, strict=True)], size)
    hazards = Hazards()
    with torch.inference_mode():
        pick = watch(hazards, sampler.pick, logits)[:rows].tolist()
    assert hazards.syncs == []
    specs = [
        sampler_row(p, [1, 2], [4] * n, [0], seed=s, generator=None, device=DEVICE)
        for p, s, n in zip(params, seeds, counts, strict=True)
    ]
    eager = sample_rows(logits[:rows], specs)
    # (repr: the NaN row's logprob is NaN on both sides)
    assert [(int(t), repr(lp), flag) for t, lp, flag in pick] == [(r.token_id, repr(r.logprob), 0.0) for r in eager]  # type: ignore[union-attr]
    for j in range(rows):
        alone = sample_rows(logits[j : j + 1], specs[j : j + 1])[0]
        assert alone.token_id == int(pick[j][0])  # type: ignore[union-attr]
    assert int(pick[0][0]) == int(logits[0].argmax())  # the greedy row: the raw argmax


def test_a_step_without_top_k_and_top_p_replays_a_graph_without_their_stages():
    """`kind`: a step whose sampled rows set no top_k, top_p or min_p replays the graph without those
    stages (no sort of the vocabulary); a greedy row's top_p (not sampled) does not count."""
    plain = [SamplingParams(**OPTIONS[i]) for i in (0, 1, 2)]
    assert kind(plain) == SAMPLED
    assert kind([*plain, SamplingParams(top_p=0.5, top_k=3, min_p=0.1)]) == SAMPLED  # greedy: not used
    for filtered in OPTIONS[3:]:  # (a top_k past the vocabulary too)
        assert kind([*plain, SamplingParams(**filtered)]) == FILTERED


def test_the_pick_without_top_k_and_top_p_is_the_same_without_a_sort(gpu_sampler):
    """Rows that set none of them (greedy, temperatures): the pick without the stages is the one with them
    and `sample_rows`'s, bit for bit, and runs no `topk` or `sort` (the GPU's largest sampling cost)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    chosen = [0, 1, 2, 1]
    logits = _logits(8)[: len(chosen)]
    params = [SamplingParams(**OPTIONS[i]) for i in chosen]
    sampler = GraphSampler(8, logits.shape[-1], DEVICE, pin=False)
    sampler.fill([(p, 7 + n, 2 * n, None, ()) for n, p in enumerate(params)], 8)
    ops = Ops()
    with torch.inference_mode():
        with ops:
            light = sampler.pick(logits, filtered=False).tolist()
        full = sampler.pick(logits).tolist()
    assert not {"topk", "sort"} & set(ops.names), ops.names
    specs = [
        sampler_row(p, [1, 2], [4] * (2 * n), [0], seed=7 + n, generator=None, device=DEVICE)
        for n, p in enumerate(params)
    ]
    eager = [(r.token_id, repr(r.logprob), 0.0) for r in sample_rows(logits, specs)]  # type: ignore[union-attr]
    assert [(int(t), repr(lp), f) for t, lp, f in light] == [(int(t), repr(lp), f) for t, lp, f in full] == eager


def test_a_graphs_draw_moves_with_the_index_and_the_seed(gpu_sampler):
    logits = _logits(1, 3000).div(20)  # flat: many tokens likely
    params = SamplingParams(do_sample=True)
    sampler = GraphSampler(1, logits.shape[-1], DEVICE, pin=False)

    def token(seed: int, index: int) -> int:
        sampler.fill([(params, seed, index, None, ())], 1)
        return int(sampler.pick(logits)[0, 0])

    assert len({token(1, i) for i in range(8)}) > 1
    assert len({token(s, 0) for s in range(8)}) > 1
    assert token(5, 3) == token(5, 3)


def test_an_undrawable_row_in_a_graphs_pick_fails_that_row_alone():
    applied: list[tuple[int, int]] = []
    steps = StepsInFlight(lambda seq_id, token: applied.append((seq_id, token)))
    out = StepOutput()
    steps.add(out, [7, 8], lambda: [[3.0, -0.5, 0.0], [4.0, -0.25, 1.0]])
    steps.receive()
    assert applied == [(7, 3)] and [s.token_id for s in out.samples[7]] == [3]
    assert out.errors == {8: f"exception occurred during sampling: {UNDRAWABLE}"}


async def _serve(loaded, config: EngineConfig, options: list[dict]) -> list[list[int]]:
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int, prompt: str) -> list[int]:
        await asyncio.sleep(0.01 * i)  # later requests join a running batch
        params = SamplingParams(max_new_tokens=12, ignore_eos_token=True, seed=40 + i, **options[i % len(options)])
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token]

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await engine.stop()


@pytest.mark.parametrize(
    "overlap,chosen",
    [(False, (2, 0, 6, 4)), (True, (2, 0, 6, 4)), (True, (2, 0, 1))],
    ids=["serial", "overlapped", "overlapped-temperature-only"],
)
async def test_an_engine_whose_graphs_sample_gives_the_eager_samplers_tokens(
    tiny_model, monkeypatch, gpu_sampler, overlap, chosen
):
    """Seeded sampled requests beside greedy ones, joining a running batch: the tokens of an engine whose
    decode graphs sample (and, overlapped, chain from the step before on the device: a chained row's draw
    at the index of the token in flight) are those of an eager engine's sampler; the sampled graphs ran, of
    the kind the rows ask for (without top_k, top_p and min_p: the graph without their stages)."""
    options = [OPTIONS[i] for i in chosen]
    config = EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=overlap)
    eager = await _serve(tiny_model, EngineConfig(max_running=6, max_prefill_tokens=8, enforce_eager=True), options)
    record = graphs_on_the_test_device(monkeypatch)
    sampled: list[bool] = []
    kinds: list[str] = []

    class Made(list):  # the graphs each engine takes (`graphs_on_the_test_device`): their sampled steps counted
        def append(self, graphs) -> None:  # noqa: ANN001
            sample = graphs.sample

            def counted(rows, book=None):  # noqa: ANN001, ANN202
                sampled.append(sample(rows, book))
                kinds.append(kind(row[0] for row in rows))
                return sampled[-1]

            graphs.sample = counted
            super().append(graphs)

    record.made = Made()
    graphed = await _serve(tiny_model, config, options)
    assert graphed == eager
    assert sum(sampled) >= 5  # steps whose graph sampled
    if any({"top_k", "top_p", "min_p"} & set(OPTIONS[i]) for i in chosen):  # (and, as requests end, without)
        assert FILTERED in kinds
    else:
        assert set(kinds) == {SAMPLED}
    if overlap:
        assert record.chained > 0


# rows a graph cannot sample (a logit bias, a top-N past its reach) beside rows it samples (a penalty's too)
# or picks, some with a top-N
MIXED = [
    {},  # greedy
    {"do_sample": True, "top_p": 0.9, "temperature": 0.8, "top_n_tokens": 2},
    {"top_n_tokens": 3},  # greedy with the top 3
    {"do_sample": True, "temperature": 0.7},
    {"do_sample": True, "repetition_penalty": 1.3},
    {"logit_bias": {5: 2.0}, "top_n_tokens": 2},
    {"top_n_tokens": GRAPH_TOP_N + 5},  # greedy, more top-N than a graph's step gives
]


def _record_steps(monkeypatch, record, eager_row) -> list[list[tuple]]:  # noqa: ANN001
    """From now on, each step's sampling (`_finish_rows`) as a list, in order: ("sent", rows) where a graph's
    pick was sent, ("eager", [eager_row(row) for each row]) where the eager sampler sampled rows."""
    steps: list[list[tuple]] = []
    finish = PersistentBatchRunner._finish_rows

    def finish_rows(self, *args):  # noqa: ANN001, ANN202
        steps.append([])
        return finish(self, *args)

    original = eager_sampling.sample_rows

    def recording(logits, rows):  # noqa: ANN001, ANN202 - sample_rows'
        steps[-1].append(("eager", [eager_row(row) for row in rows]))
        return original(logits, rows)

    monkeypatch.setattr(PersistentBatchRunner, "_finish_rows", finish_rows)
    monkeypatch.setattr(eager_sampling, "sample_rows", recording)

    class Made(list):
        def append(self, graphs) -> None:  # noqa: ANN001
            send = graphs.send_pick

            def sent(logits, sampled=False, top_n=0):  # noqa: ANN001, ANN202 - DecodeGraphs.send_pick's
                receive = send(logits, sampled, top_n)
                if receive is not None:
                    steps[-1].append(("sent", len(logits)))
                return receive

            graphs.send_pick = sent
            super().append(graphs)

    record.made = Made()
    return steps


def _split(steps: list[list[tuple]]) -> list[tuple[int, list]]:
    """The steps whose graph's pick was sent while the eager sampler sampled rows: (the pick's rows, what
    `_record_steps` recorded of the eager rows)."""
    out = []
    for calls in steps:
        sent = [c[1] for c in calls if c[0] == "sent"]
        eager = [flag for c in calls if c[0] == "eager" for flag in c[1]]
        if sent and eager:
            out.append((sent[0], eager))
    return out


async def _serve_detail(loaded, config: EngineConfig, options: list[dict] = MIXED) -> list[list[tuple]]:
    """A request of each of `options` (default `MIXED`), joining a running batch: each token's id, logprob and
    top tokens."""
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int) -> list[tuple]:
        await asyncio.sleep(0.01 * i)
        params = SamplingParams(max_new_tokens=12, ignore_eos_token=True, seed=40 + i, **options[i])
        return [
            (e.token.id, e.token.logprob, [(t.id, t.logprob) for t in e.top_tokens or ()])
            async for e in engine.generate(GenerationRequest(PROMPTS[i % len(PROMPTS)], params))
            if e.token
        ]

    try:
        return await asyncio.gather(*(one(i) for i in range(len(options))))
    finally:
        await engine.stop()


async def test_rows_a_graph_cannot_sample_leave_only_themselves_to_the_eager_sampler(
    tiny_model, monkeypatch, gpu_sampler
):
    """A step with rows the graph cannot sample (a logit bias, a top-N past `GRAPH_TOP_N`) beside
    rows it samples and greedy ones, some with a top-N: the graph samples its rows and its pick serves them with their top-N, the eager
    sampler takes the others alone from the logits; every token, logprob and top-N is the eager engine's."""
    config = EngineConfig(max_running=8, max_prefill_tokens=8)
    eager = await _serve_detail(tiny_model, dataclasses.replace(config, enforce_eager=True))
    record = graphs_on_the_test_device(monkeypatch)
    steps = _record_steps(monkeypatch, record, lambda row: in_graph(row.params))
    graphed = await _serve_detail(tiny_model, config)
    for ours, theirs in zip(graphed, eager, strict=True):
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        assert [t[1] for t in ours] == pytest.approx([t[1] for t in theirs], abs=1e-5)
        assert [[i for i, _ in t[2]] for t in ours] == [[i for i, _ in t[2]] for t in theirs]
    assert any(kind_ != "greedy" for _, kind_ in record.kinds)  # sampled graphs ran beside the eager rows
    split = _split(steps)
    assert len(split) >= 3, steps  # graph steps whose pick served rows while others were sampled eagerly
    assert not any(flag for _, eager in split for flag in eager)  # none of them a row the graph sampled
    # (steps of most of the rows: how many run at once depends on the steps' pace, a GPU's faster than a CPU's)
    assert max(rows for rows, _ in split) >= (6 if tiny_model.device.type == "cpu" else 4)
    assert [len(t[2]) for t in graphed[6]] == [GRAPH_TOP_N + 5] * 12


async def test_a_grammars_rows_leave_the_others_to_the_graph(tiny_model, monkeypatch, gpu_sampler):
    """Constrained requests (a JSON schema, a regex) beside greedy and seeded sampled ones: the graphs sample
    and pick the unconstrained rows, the constrained ones alone are masked and sampled from the logits; every
    request's tokens are the eager engine's, and the constrained texts match their grammars."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammars = [Grammar("json_schema", json.dumps(schema)), Grammar("regex", "[0-9]{3}-[a-z]{2,6}")]
    options = [
        {},
        {"grammar": grammars[0]},
        {"do_sample": True, "seed": 11, "temperature": 0.8},
        {"grammar": grammars[1], "do_sample": True, "seed": 2},
        {"do_sample": True, "seed": 5, "top_p": 0.9},
    ]

    async def serve(config: EngineConfig) -> list[tuple[list[int], str]]:
        engine = create_engine(tiny_model, config)
        engine.start()

        async def one(i: int) -> tuple[list[int], str]:
            await asyncio.sleep(0.01 * i)
            params = SamplingParams(max_new_tokens=40, **options[i])
            events = [e async for e in engine.generate(GenerationRequest(PROMPTS[i], params))]
            finish = [e.finish for e in events if e.finish is not None][-1]
            return [e.token.id for e in events if e.token], finish.generated_text

        try:
            return await asyncio.gather(*(one(i) for i in range(len(options))))
        finally:
            await engine.stop()

    eager = await serve(EngineConfig(max_running=5, max_prefill_tokens=8, enforce_eager=True))
    record = graphs_on_the_test_device(monkeypatch)
    # (a constrained request's rows: masked, or with overlap scheduling one held for a mask that its request,
    # ended by the token before, no longer takes: sampled unmasked, its token dropped)
    steps = _record_steps(monkeypatch, record, lambda row: row.params.grammar is not None)
    graphed = await serve(EngineConfig(max_running=5, max_prefill_tokens=8))
    assert graphed == eager
    assert json.loads(graphed[1][1])["n"] is not None and re.fullmatch("[0-9]{3}-[a-z]{2,6}", graphed[3][1])
    assert any(kind_ != "greedy" for _, kind_ in record.kinds)  # the sampled rows' graphs ran
    split = _split(steps)
    assert len(split) >= 3, steps  # graph steps whose pick served rows while the constrained ones were masked
    assert all(all(eager) for _, eager in split)  # those alone


async def test_top_n_rows_sample_in_the_graph_and_chain(tiny_model, monkeypatch, gpu_sampler):
    """Greedy and sampled rows asking for their top-N tokens: the graphs pick and sample them, the top-N go
    with the pick (no row reaches the eager sampler once every row decodes), the steps chain on the device,
    and every token, logprob and top-N is the eager engine's."""
    options = [
        {"top_n_tokens": 3},
        {"do_sample": True, "temperature": 0.8, "top_n_tokens": 2},
        {},
        {"do_sample": True, "top_p": 0.9, "top_n_tokens": GRAPH_TOP_N},
    ]
    config = EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=True)
    eager = await _serve_detail(tiny_model, dataclasses.replace(config, enforce_eager=True), options)
    record = graphs_on_the_test_device(monkeypatch)
    steps = _record_steps(monkeypatch, record, lambda row: row.params.top_n_tokens)
    graphed = await _serve_detail(tiny_model, config, options)
    for ours, theirs in zip(graphed, eager, strict=True):
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        assert [t[1] for t in ours] == pytest.approx([t[1] for t in theirs], abs=1e-5)
        assert [[i for i, _ in t[2]] for t in ours] == [[i for i, _ in t[2]] for t in theirs]
        assert [v for t in ours for _, v in t[2]] == pytest.approx([v for t in theirs for _, v in t[2]], abs=1e-5)
    assert [len(t[2]) for t in graphed[3]] == [GRAPH_TOP_N] * 12
    assert record.chained > 0 and any(kind_ != "greedy" for _, kind_ in record.kinds)
    assert not _split(steps) and sum(any(c[0] == "sent" for c in calls) for calls in steps) >= 8, steps


async def test_a_failing_top_n_leaves_its_step_to_the_eager_sampler(tiny_model, monkeypatch, gpu_sampler):
    """The top-N taken after a graph's replay fails (its memory, say) in one step: that step's rows are sampled
    from the logits by the eager sampler, and every request gets the eager engine's tokens and top-N."""
    options = [{"top_n_tokens": 3}, {"do_sample": True, "top_n_tokens": 2}, {}]
    config = EngineConfig(max_running=4, max_prefill_tokens=8)
    eager = await _serve_detail(tiny_model, dataclasses.replace(config, enforce_eager=True), options)
    graphs_on_the_test_device(monkeypatch)
    real, calls = graph_sampling.with_top_n, []

    def failing(pick, logits, top_n):  # noqa: ANN001, ANN202 - with_top_n's
        calls.append(top_n)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real(pick, logits, top_n)

    monkeypatch.setattr(graph_sampling, "with_top_n", failing)
    graphed = await _serve_detail(tiny_model, config, options)
    assert len(calls) > 3  # (the steps after it took their top-N from the graph again)
    for ours, theirs in zip(graphed, eager, strict=True):
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        assert [[i for i, _ in t[2]] for t in ours] == [[i for i, _ in t[2]] for t in theirs]


async def test_a_step_whose_eager_rows_all_fail_ends_those_requests_alone(tiny_model, monkeypatch, gpu_sampler):
    """Overlapped steps where the graph's pick serves some rows and the one row left to the eager sampler
    fails before it is sampled: that request ends with the error, and the served rows' tokens are the
    eager engine's. (The runner also receives such a step's served picks at once: a step of part of a
    graph's rows must never be chained from; the engine does not plan a step ahead of one with such a row.)"""
    options = [{}, {"do_sample": True, "temperature": 0.8}, {"top_n_tokens": 2}, {}]
    config = EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=True)
    eager = await _serve_detail(tiny_model, dataclasses.replace(config, enforce_eager=True), options)
    graphs_on_the_test_device(monkeypatch)
    row_of = PersistentBatchRunner._row_of

    def refusing(self, request, device, masked):  # noqa: ANN001, ANN202 - the penalty row's Row fails
        if request.params.repetition_penalty != 1.0 and len(request.output_ids) >= 3:
            raise RuntimeError("no Row for you")
        return row_of(self, request, device, masked)

    monkeypatch.setattr(PersistentBatchRunner, "_row_of", refusing)
    engine = create_engine(tiny_model, config)
    engine.start()

    async def penalized() -> str | None:
        params = SamplingParams(max_new_tokens=12, ignore_eos_token=True, repetition_penalty=1.3)
        events = [e async for e in engine.generate(GenerationRequest(PROMPTS[4], params))]
        return [e.finish for e in events if e.finish is not None][-1].error

    async def served(i: int) -> list[int]:
        await asyncio.sleep(0.01 * i)
        params = SamplingParams(max_new_tokens=12, ignore_eos_token=True, seed=40 + i, **options[i])
        request = GenerationRequest(PROMPTS[i % len(PROMPTS)], params)
        return [e.token.id async for e in engine.generate(request) if e.token]

    try:
        error, *tokens = await asyncio.gather(penalized(), *(served(i) for i in range(len(options))))
    finally:
        await engine.stop()
    assert error is not None and "no Row for you" in error
    assert tokens == [[t[0] for t in request] for request in eager]


def test_a_top_n_past_the_vocabulary_from_a_graphs_pick_is_the_eager_samplers():
    """A top-N wider than the vocabulary (a tiny model's) sent with a graph's pick: every token, as the eager
    sampler caps it, for each row its own N."""
    torch.manual_seed(3)
    logits = torch.randn(2, 4)
    packed = graph_sampling.with_top_n(sampling.greedy_pick(logits), logits, 6)
    out, steps = StepOutput(), StepsInFlight(lambda seq_id, token: None)
    steps.add(out, [1, 2], packed.tolist, [6, 2])
    steps.receive()
    rows = [sampler_row(SamplingParams(top_n_tokens=n), [1], [], [0], None, None) for n in (6, 2)]
    eager = sample_rows(logits, rows)
    for seq_id, expected in zip((1, 2), eager, strict=True):
        ours = out.samples[seq_id][0]
        assert (ours.token_id, [i for i, _ in ours.top]) == (expected.token_id, [i for i, _ in expected.top])
        assert [v for _, v in ours.top] == pytest.approx([v for _, v in expected.top])
    assert len(out.samples[1][0].top) == 4 and len(out.samples[2][0].top) == 2
