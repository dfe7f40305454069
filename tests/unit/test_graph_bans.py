"""`min_new_tokens` inside a decode graph (engine/runner/graph_sampling.py): until a row has that many tokens
the graph bans its EOS and stop ids (up to `GRAPH_BANNED` of them, from buffers the host fills each step), so
a step of such rows (what benchmark clients send: vLLM's ``min_tokens`` with ``ignore_eos``) replays a graph
and chains as any other. The graph's pick is the eager sampler's, bit for bit, before and after the ban
ends; an engine whose graphs ban gives the tokens of an eager engine. On a CPU the graphs' step runs from the
same buffers without a capture and the sampler takes the GPU's paths (`gpu_sampler`, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from helpers.capture_hazards import Hazards, watch
from helpers.decode_graphs import graphs_on_the_test_device
from helpers.llama_variants import PROMPTS
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.runner import eager_sampling
from lmiserve.engine.runner.graph_sampling import GRAPH_BANNED, PENALIZED, GraphSampler, in_graph
from lmiserve.engine.runner.sampling import banned_ids, sample_rows, sampler_row

pytest.importorskip("triton")

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))


def test_a_row_whose_ids_fit_the_graphs_buffers_samples_in_it():
    assert in_graph(SamplingParams(min_new_tokens=3), banned=2)
    assert in_graph(SamplingParams(do_sample=True, top_p=0.9, min_new_tokens=3), banned=GRAPH_BANNED)
    assert in_graph(SamplingParams(repetition_penalty=1.1, min_new_tokens=3), banned=1)
    assert not in_graph(SamplingParams(min_new_tokens=3), banned=GRAPH_BANNED + 1)  # the eager sampler's
    eos = [2, 7]
    assert banned_ids(SamplingParams(min_new_tokens=3, stop_token_ids=[9]), eos) == [2, 7, 9]
    assert banned_ids(SamplingParams(stop_token_ids=[9]), eos) == []  # (no min_new_tokens: nothing banned)


def test_a_graphs_pick_bans_what_the_eager_sampler_bans(gpu_sampler):
    """Greedy and sampled rows with `min_new_tokens`, before it (their likeliest tokens banned: stop ids past
    the EOS, up to `GRAPH_BANNED` ids) and after it, a NaN row's, beside plain rows, padded: each row's token
    and logprob are `sample_rows`'s, bit for bit; no banned id is picked; the pick reads nothing on the host."""
    size = 10
    logits = torch.randn(size, 700, generator=torch.Generator().manual_seed(11)) * 3
    logits[2, 5] = float("nan")
    logits[2, 30:40] = float("-inf")
    logits = logits.to(DEVICE)
    likeliest = logits.nan_to_num(nan=float("-inf")).argsort(-1, descending=True).tolist()
    eos = [likeliest[0][0], likeliest[3][0], likeliest[5][0]]  # (the model's: every row's ids begin with them)
    stop = [likeliest[n][:3] for n in range(size)]  # each row's own likeliest three
    rows = [  # (params, tokens so far)
        (SamplingParams(min_new_tokens=3, stop_token_ids=stop[0]), 0),  # greedy, banned: its 4th likeliest
        (SamplingParams(min_new_tokens=3, stop_token_ids=stop[1]), 5),  # greedy, past it: its argmax
        (SamplingParams(min_new_tokens=2), 0),  # greedy, a NaN: processed as the eager sampler does
        (SamplingParams(do_sample=True, temperature=0.7, min_new_tokens=4, stop_token_ids=likeliest[3][:13]), 1),
        (SamplingParams(do_sample=True, top_p=0.9, min_new_tokens=4, stop_token_ids=stop[4]), 4),  # past it
        (SamplingParams(do_sample=True, top_k=5, min_new_tokens=10, stop_token_ids=stop[5]), 2),
        (SamplingParams(), 3),  # plain greedy: the raw argmax
        (SamplingParams(do_sample=True, temperature=1.3), 6),  # sampled, no ban
    ]
    assert len(banned_ids(rows[3][0], eos)) == GRAPH_BANNED
    banned = [banned_ids(p, eos) if n < p.min_new_tokens else [] for p, n in rows]
    sampler = GraphSampler(size, logits.shape[-1], DEVICE, pin=False)
    sampler.fill([(p, 20 + j, n, None, banned[j]) for j, (p, n) in enumerate(rows)], size)
    hazards = Hazards()
    with torch.inference_mode():
        pick = watch(hazards, sampler.pick, logits, filtered=True)[: len(rows)].tolist()
    assert hazards.syncs == []
    specs = [sampler_row(p, [1, 2], [4] * n, eos, 20 + j, None, DEVICE) for j, (p, n) in enumerate(rows)]
    eager = sample_rows(logits[: len(rows)], specs)
    assert [(int(t), repr(lp), flag) for t, lp, flag in pick] == [(r.token_id, repr(r.logprob), 0.0) for r in eager]  # type: ignore[union-attr]
    tokens = [int(t) for t, _, _ in pick]
    assert all(tokens[j] not in banned[j] for j in range(len(rows)))
    assert tokens[0] == likeliest[0][3] and tokens[1] == likeliest[1][0] and tokens[6] == likeliest[6][0]
    assert tokens[3] not in likeliest[3][:13]  # (its likeliest 13 and the EOS ids banned)


# what benchmark clients send (min_tokens = max_tokens, ignore_eos), greedy and sampled, with a penalty too
OPTIONS = [
    {},
    {"do_sample": True, "temperature": 0.7},
    {"do_sample": True, "top_p": 0.9},
    {"repetition_penalty": 1.3},
]


async def _serve(loaded, config: EngineConfig, options: list[dict]) -> list[list[tuple]]:  # noqa: ANN001
    """Each prompt's request (with `options[i]`), joining a running batch: each token's id, its logprob and
    the likeliest token of the raw logits (its top-N of one)."""
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int) -> list[tuple]:
        await asyncio.sleep(0.01 * i)
        params = SamplingParams(max_new_tokens=12, ignore_eos_token=True, seed=80 + i, top_n_tokens=1, **options[i])
        request = GenerationRequest(PROMPTS[i], params)
        return [(e.token.id, e.token.logprob, e.top_tokens[0].id) async for e in engine.generate(request) if e.token]

    try:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        await engine.stop()


def _options(stops: list[list[int]]) -> list[dict]:
    return [{"min_new_tokens": 9, "stop_token_ids": stops[i], **OPTIONS[i % len(OPTIONS)]} for i in range(len(PROMPTS))]


_STOPS: list[list[int]] = []  # (`_stops`' answer, the same for every config: the eager engine's tokens)


async def _stops(loaded, config: EngineConfig) -> list[list[int]]:  # noqa: ANN001
    """Each request's stop ids, so that its ban bites (on this random model it rarely would by chance): one a
    round, the raw argmax at its first token of 10 whose argmax is not a stop id yet, until each of its 9
    banned tokens' is, and the 10th's, which ends it there (or 12 ids)."""
    if _STOPS:
        return _STOPS
    stops: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(12):
        answers = await _serve(loaded, config, _options(stops))
        free = [[top for _, _, top in answer[:10] if top not in stops[i]] for i, answer in enumerate(answers)]
        if not any(free):
            break
        for i, tops in enumerate(free):
            stops[i] += tops[:1]
    _STOPS.extend(stops)
    return stops


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
async def test_an_engine_whose_graphs_ban_gives_the_eager_engines_tokens(tiny_model, monkeypatch, gpu_sampler, overlap):
    """Requests whose `min_new_tokens` bans stop ids (which end them once past it), greedy, sampled and
    penalized, joining a running batch: every token and logprob is the eager engine's; the graphs banned in
    most of the rows' steps (overlapped: chaining from the step before, the token in flight counted), and the
    ban bit there (a greedy row's token not its raw argmax)."""
    config = EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=overlap)
    eager_config = dataclasses.replace(config, enforce_eager=True)
    options = _options(await _stops(tiny_model, eager_config))
    eager = await _serve(tiny_model, eager_config, options)
    record = graphs_on_the_test_device(monkeypatch)
    banning: list[int] = []  # each sampled graph's step: its rows with ids banned
    fill = GraphSampler.fill

    def recorded(sampler, rows, size, book=None):  # noqa: ANN001, ANN202 - GraphSampler.fill's
        banning.append(sum(bool(row[4]) for row in rows))
        return fill(sampler, rows, size, book)

    monkeypatch.setattr(GraphSampler, "fill", recorded)
    eager_rows: list[int] = []  # the eager sampler's rows with `min_new_tokens`
    original = eager_sampling.sample_rows

    def recording(logits, rows):  # noqa: ANN001, ANN202 - sample_rows'
        eager_rows.extend(r.params.min_new_tokens > 0 for r in rows)
        return original(logits, rows)

    monkeypatch.setattr(eager_sampling, "sample_rows", recording)
    graphed = await _serve(tiny_model, config, options)
    for ours, theirs in zip(graphed, eager, strict=True):
        assert [t[0] for t in ours] == [t[0] for t in theirs]
        assert [t[1] for t in ours] == pytest.approx([t[1] for t in theirs], abs=1e-5)
    greedy = [eager[i][1:9] for i in range(0, len(PROMPTS), len(OPTIONS))]  # (their tokens 2 to 9, decode steps)
    bitten = sum(token != top for steps in greedy for token, _, top in steps)
    assert bitten >= 8, (bitten, _STOPS)
    # (and the ban ends on time: the 10th token, the first not banned, is a stop id that ends it)
    assert sum(len(eager[i]) == 10 for i in range(0, len(PROMPTS), len(OPTIONS))) >= 1, (eager, _STOPS)
    assert any(kind_.endswith(PENALIZED) for _, kind_ in record.kinds)
    # (5 requests, 8 ban steps each after their first token: 27 rows banned in graphs, up to all 5 at once; 18
    # by the eager sampler, in steps with prompt chunks)
    # (how many at once depends on the steps' pace: on a GPU the first may end before the last joins)
    together = 5 if tiny_model.device.type == "cpu" else 3
    assert sum(banning) >= 20 and max(banning) >= together, (banning, sum(eager_rows))
    if overlap:
        assert record.chained > 0
