"""Penalties inside a decode graph (engine/runner/graph_sampling.py, `PENALIZED`): a penalized row's graph reads
its request's dense rows in the runner's `PenaltyBook` (engine/runner/penalties.py) and marks its input token
there, so a step of penalized rows replays a graph and chains as any other. The graph's pick is the eager
sampler's from the request's lists, bit for bit; the book's rows after it are those of the whole lists; and an
engine whose graphs penalize gives the tokens of an eager engine, as its book grows past the rows the graphs
first read and when the graphs stop sampling midway. On a CPU the graphs' step runs from the same buffers
without a capture, the sampler and the book take the GPU's paths (`gpu_sampler`), and each step is watched for
what a capture cannot hold (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random

import pytest
import torch

from helpers.capture_hazards import Hazards, watch
from helpers.decode_graphs import graphs_on_the_test_device
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs, _Captured
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.runner import eager_sampling, penalties
from lmiserve.engine.runner.graph_sampling import FILTERED, PENALIZED, SAMPLED, GraphSampler, kind, stages
from lmiserve.engine.runner.penalties import FIRST_SLOTS, PenaltyBook
from lmiserve.engine.runner.sampling import sample_rows, sampler_row

pytest.importorskip("triton")

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
VOCAB = 700

ROWS = [  # penalized rows of every kind a graph takes, beside rows without a penalty
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(do_sample=True, repetition_penalty=1.2, top_p=0.9, temperature=0.8),
    SamplingParams(do_sample=True, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(frequency_penalty=1.0, top_n_tokens=2),
    SamplingParams(),  # greedy: the raw argmax
    SamplingParams(do_sample=True, temperature=0.7),
    SamplingParams(repetition_penalty=0.7, presence_penalty=-0.4, top_k=5, do_sample=True),
    SamplingParams(repetition_penalty=1.5),  # its logits hold a NaN and removed tokens
]


def _logits(rows: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    logits[7, 10:20] = float("-inf")
    logits[7, 5] = float("nan")
    return logits.to(DEVICE)


def test_a_penalized_step_is_its_own_kind():
    plain, penalized = SamplingParams(do_sample=True), SamplingParams(repetition_penalty=1.2)
    assert kind([plain, penalized]) == SAMPLED + PENALIZED and stages(SAMPLED + PENALIZED) == (False, True)
    filtered = SamplingParams(do_sample=True, top_p=0.9, frequency_penalty=0.1)
    assert kind([plain, filtered]) == FILTERED + PENALIZED and stages(FILTERED + PENALIZED) == (True, True)
    assert kind([plain]) == SAMPLED and stages(FILTERED) == (True, False)


@pytest.mark.parametrize("filtered", [True, False], ids=["filtered", "unfiltered"])
def test_a_graphs_penalized_pick_is_the_eager_samplers_and_marks_its_input_tokens(gpu_sampler, filtered):
    """Rows of every penalty, padded to a larger graph, each request with a prompt and an output whose last
    token is the step's input: the book flushed up to the token before it, the pick (which marks the input
    tokens, then penalizes) gives `sample_rows`'s tokens and logprobs from the lists, bit for bit, reading
    nothing on the host; after it, the book's rows of each request are those of its whole lists."""
    rng = random.Random(11)
    chosen = [n for n, p in enumerate(ROWS) if filtered or not stages(kind([p]))[0]]
    params, logits = [ROWS[n] for n in chosen], _logits(len(ROWS))[chosen]
    rows, size = len(params), 16
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))] for _ in params]
    outputs = [[rng.randrange(40) for _ in range(rng.randrange(1, 30))] for _ in params]  # (repeats)
    book = PenaltyBook()
    book.pin()
    slots = {n: book.open(prompts[n], outputs[n]) for n, p in enumerate(params) if penalties.penalized(p)}
    book.flush(DEVICE, VOCAB, list(slots.values()), [len(outputs[n]) - 1 for n in slots])
    assert all(book.taken(slot) == len(outputs[n]) - 1 for n, slot in slots.items())
    sampler = GraphSampler(size, VOCAB, DEVICE, pin=False)
    sampler.fill([(p, 30 + n, len(outputs[n]), slots.get(n), ()) for n, p in enumerate(params)], size, book)
    inputs = torch.tensor([o[-1] for o in outputs] + [0] * (size - rows), device=DEVICE)
    padded = torch.cat((logits, torch.zeros(size - rows, VOCAB, device=DEVICE)))
    hazards = Hazards()
    with torch.inference_mode():
        pick = watch(hazards, sampler.pick, padded, filtered, inputs)[:rows].tolist()
    assert hazards.found == []
    specs = [
        sampler_row(p, prompts[n], outputs[n], [0], seed=30 + n, generator=None, device=DEVICE)
        for n, p in enumerate(params)
    ]
    eager = sample_rows(logits, specs)  # (no book: the lists)
    assert [(int(t), repr(lp), flag) for t, lp, flag in pick] == [(r.token_id, repr(r.logprob), 0.0) for r in eager]  # type: ignore[union-attr]
    book.taken_by_graph(list(slots.values()))
    whole = PenaltyBook()
    where = {n: whole.open(prompts[n], outputs[n]) for n in slots}
    whole.flush(DEVICE, VOCAB, list(where.values()))
    assert book.seen is not None and whole.seen is not None and book.counts is not None and whole.counts is not None
    for n, slot in slots.items():
        assert torch.equal(book.seen[slot], whole.seen[where[n]]), n
        assert torch.equal(book.counts[slot], whole.counts[where[n]]), n
        assert book.taken(slot) == len(outputs[n])
    before = book.counts.clone()
    book.flush(DEVICE, VOCAB, list(slots.values()))  # (nothing left to take)
    assert torch.equal(book.counts, before)


def test_a_pinned_book_keeps_its_rows_and_a_scratch_row(gpu_sampler):
    """Pinned, the rows outlive their requests and hold one row past the slots handed out; their growth (more
    requests at once than they hold) is a new `version` (the graphs that read the old rows are captured again)."""
    book = PenaltyBook()
    book.pin()
    first = [book.open([1, 2], [3]) for _ in range(FIRST_SLOTS - 1)]
    book.flush(DEVICE, VOCAB, first)
    assert book.slots == FIRST_SLOTS and book.scratch == FIRST_SLOTS - 1 and book.version == 1
    more = book.open([4], [5])
    book.flush(DEVICE, VOCAB, [more])
    assert book.slots == 2 * FIRST_SLOTS and book.scratch not in [*first, more] and book.version == 2
    sampler = GraphSampler(4, VOCAB, DEVICE, pin=False)
    assert sampler.moved(SAMPLED + PENALIZED, book) and not sampler.moved(SAMPLED + PENALIZED, book)
    assert not sampler.moved(SAMPLED, book)
    for slot in [*first, more]:
        book.close(slot)
    assert book.slots == 2 * FIRST_SLOTS and book.version == 2  # (unpinned, they would be let go)


OPTIONS = [
    {"repetition_penalty": 1.3},
    {"do_sample": True, "repetition_penalty": 1.2, "top_p": 0.9},
    {"do_sample": True, "presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"frequency_penalty": 1.0, "top_n_tokens": 2},
    {"do_sample": True, "temperature": 0.7},
    {"repetition_penalty": 0.8, "presence_penalty": -0.3},
]
PROMPTS = [f"{word} is a word that" for word in ("apple", "river", "stone", "cloud", "green", "seven", "north")]
PROMPTS += [f"Count: {n}, {n + 1}," for n in range(5)]  # 12 requests, 10 of them penalized


async def _serve(loaded, config: EngineConfig) -> tuple[list[list[tuple]], object]:  # noqa: ANN001
    """Each prompt's request (`OPTIONS` in turn), joining a running batch: each token's id, logprob and top-N,
    and the engine's runner."""
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int) -> list[tuple]:
        await asyncio.sleep(0.01 * i)
        params = SamplingParams(max_new_tokens=24, ignore_eos_token=True, seed=60 + i, **OPTIONS[i % len(OPTIONS)])
        return [
            (e.token.id, e.token.logprob, [(t.id, t.logprob) for t in e.top_tokens or ()])
            async for e in engine.generate(GenerationRequest(PROMPTS[i], params))
            if e.token
        ]

    try:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), engine.runner
    finally:
        await engine.stop()


def _same(graphed: list[list[tuple]], eager: list[list[tuple]]) -> None:
    for ours, theirs in zip(graphed, eager, strict=True):
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        assert [t[1] for t in ours] == pytest.approx([t[1] for t in theirs], abs=1e-5)
        assert [[i for i, _ in t[2]] for t in ours] == [[i for i, _ in t[2]] for t in theirs]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
async def test_an_engine_whose_graphs_penalize_gives_the_eager_engines_tokens(
    tiny_model, monkeypatch, gpu_sampler, overlap
):
    """Penalized requests of every kind beside plain ones, joining a running batch, more of them at once than
    the book's first rows hold: every token, logprob and top-N is the eager engine's; penalized graphs ran
    (overlapped: chaining from the step before on the device) with most penalized rows in them, and the book
    grew once the graphs read it (their version followed)."""
    config = EngineConfig(max_running=12, max_prefill_tokens=8, async_scheduling=overlap)
    eager, _ = await _serve(tiny_model, dataclasses.replace(config, enforce_eager=True))
    record = graphs_on_the_test_device(monkeypatch)
    eager_rows: list[bool] = []  # the penalized rows the eager sampler took
    original = eager_sampling.sample_rows

    def recording(logits, rows):  # noqa: ANN001, ANN202 - sample_rows'
        eager_rows.extend(penalties.penalized(r.params) for r in rows)
        return original(logits, rows)

    monkeypatch.setattr(eager_sampling, "sample_rows", recording)
    marked: list[int] = []  # each penalized graph's penalized rows
    taken_by_graph = PenaltyBook.taken_by_graph

    def counting(book, slots):  # noqa: ANN001, ANN202
        marked.append(len(slots))
        return taken_by_graph(book, slots)

    monkeypatch.setattr(PenaltyBook, "taken_by_graph", counting)
    graphed, runner = await _serve(tiny_model, config)
    _same(graphed, eager)
    assert any(kind_.endswith(PENALIZED) for _, kind_ in record.kinds)
    # (at 10 requests of 24 tokens: ~150 rows penalized in graphs, up to all 10 of a step; ~80 in steps that
    # prompt chunks made eager)
    assert sum(marked) >= 60 and max(marked) >= 8, (marked, sum(eager_rows))
    book = runner.penalties  # type: ignore[attr-defined]
    assert book.pinned and book.version >= 2
    assert runner.graphs.sampler._version == book.version  # type: ignore[attr-defined]
    if overlap:
        assert record.chained > 0


async def test_graphs_that_stop_sampling_midway_leave_the_book_right(tiny_model, monkeypatch, gpu_sampler):
    """A sampled graph's capture fails after a few penalized steps (the graphs then sample nothing): the rest
    of each request's tokens come from the eager sampler, whose book counts each token once, whichever path
    marked it, so every token is still the eager engine's."""
    config = EngineConfig(max_running=12, max_prefill_tokens=8, async_scheduling=True)
    eager, _ = await _serve(tiny_model, dataclasses.replace(config, enforce_eager=True))
    record = graphs_on_the_test_device(monkeypatch)
    steps: list[bool] = []

    class Made(list):
        def append(self, graphs) -> None:  # noqa: ANN001
            run = graphs.run

            def failing_later(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                logits = run(*args, **kwargs)
                steps.append(graphs.penalties_ran)
                if sum(steps) == 3:
                    graphs.sampler_failed = True  # (as `run` sets it when a sampled capture fails)
                return logits

            graphs.run = failing_later
            super().append(graphs)

    record.made = Made()
    graphed, _ = await _serve(tiny_model, config)
    _same(graphed, eager)
    assert sum(steps) == 3 and len(steps) > 6  # penalized graphs ran, then greedy graphs alone


async def test_a_captures_warm_up_leaves_the_book_as_its_replay_finds_it(tiny_model, monkeypatch, gpu_sampler):
    """On CUDA a new graph's step is computed twice: once by the capture's warm-up, then by the replay that
    follows the capture (which records without running). So the warm-up's marks in the book are put back, and
    each input token is counted once. Played on a CPU: each new graph's warm-up (`_warm_up`), then its step as
    the replay; every token is the eager engine's."""
    config = EngineConfig(max_running=12, max_prefill_tokens=8, async_scheduling=True)
    eager, _ = await _serve(tiny_model, dataclasses.replace(config, enforce_eager=True))
    record = graphs_on_the_test_device(monkeypatch)
    captured: list[tuple[int, str]] = []

    def played(self, size: int, kind: str) -> _Captured:  # noqa: ANN001 - DecodeGraphs._capture's
        self._warm_up(size, kind)
        columns = 2 if kind == "greedy" else 3
        replay = type("Replay", (), {"replay": lambda _: self._step(size, kind)})()
        pick = self._pick_out[: size * columns].view(size, columns)
        captured.append((size, kind))
        self._graphs[size, kind] = _Captured(replay, self._logits_out[:size], pick)
        return self._graphs[size, kind]

    class Made(list):
        def append(self, graphs) -> None:  # noqa: ANN001
            graphs.sampler = GraphSampler(graphs.sizes[-1], graphs.fast.vocab, graphs.fast.device, pin=False)
            graphs.capture = True  # (its buffers made unpinned: played on a CPU)
            super().append(graphs)

    record.made = Made()
    monkeypatch.setattr(DecodeGraphs, "_capture", played)
    counted: list[tuple[float, int]] = []  # after each penalized graph: a slot's marked output tokens, its count
    taken_by_graph = PenaltyBook.taken_by_graph

    def checked(book, slots):  # noqa: ANN001, ANN202
        taken_by_graph(book, slots)
        counted.extend((float(book.counts[slot].sum()), book.taken(slot)) for slot in slots)

    monkeypatch.setattr(PenaltyBook, "taken_by_graph", checked)
    graphed, _ = await _serve(tiny_model, config)
    _same(graphed, eager)
    assert any(kind_.endswith(PENALIZED) for _, kind_ in captured), captured
    assert len(counted) > 50 and all(marked == taken for marked, taken in counted), counted
