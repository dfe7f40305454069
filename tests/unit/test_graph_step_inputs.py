"""The host side of a decode step replayed from a CUDA graph (engine/attention/cuda_graphs.py): the block
tables persist in the host buffer and only what changed is written; each graph computes the rows' greedy
pick, which the runner takes as the step's sampling when every row is plain greedy (runner/sampling.py).
On a CPU the same buffers run without a capture (captured where LMISERVE_TEST_DEVICE is cuda)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("triton")

from helpers.decode_graphs import CAPTURE, graphs_on_the_test_device  # noqa: E402
from helpers.llama_variants import ARCHS, PROMPTS, build, greedy_tokens  # noqa: E402
from lmiserve.core.request import GenerationRequest, SamplingParams  # noqa: E402
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs  # noqa: E402
from lmiserve.engine.attention.paged import PagedKVCache  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.factory import create_engine  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama  # noqa: E402
from lmiserve.engine.runner import eager_sampling  # noqa: E402
from lmiserve.engine.runner.sampling import Row, greedy_pick, plain_greedy, sample_rows  # noqa: E402

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
SCRATCH = 40  # the pool's last block: where padding rows write


def _row(**params: object) -> Row:
    return Row(SamplingParams(**params), [1, 2], [3], [], torch.Generator().manual_seed(1))  # type: ignore[arg-type]


def test_the_greedy_pick_is_what_sample_rows_computes_for_plain_greedy_rows():
    """`greedy_pick` gives `sample_rows`' tokens and logprobs exactly; `plain_greedy` tells the rows it
    serves (no processing, no top-N)."""
    logits = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    computed = sample_rows(logits, [_row() for _ in range(5)])
    assert [(r.token_id, r.logprob) for r in computed] == [(int(t), lp) for t, lp in greedy_pick(logits).tolist()]
    assert plain_greedy(SamplingParams())
    for params in ({"repetition_penalty": 1.3}, {"top_n_tokens": 2}, {"do_sample": True}, {"min_new_tokens": 2}):
        assert not plain_greedy(SamplingParams(**params)), params  # type: ignore[arg-type]


@pytest.fixture()
def graphs(monkeypatch) -> DecodeGraphs:
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    model = build(*ARCHS["llama"]).to(DEVICE)
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, SCRATCH + 1, 4, cfg.num_key_value_heads, 16, model.dtype, DEVICE)
    fast = FastLlama(model, cache, 64)
    fast.graphs = DecodeGraphs(fast, 4, SCRATCH, capture=CAPTURE)
    return fast.graphs


def test_block_tables_persist_and_only_what_changed_is_written(graphs):
    """Steps of decode rows through `_fill`: the device tables always hold each row's table (padding rows
    the scratch block); a row that keeps its sequence's list gets only its new blocks written (a value
    planted in its host row survives), a row given another list (another sequence, rows shifted, a table
    replaced after a preemption) is written whole."""
    host, device = graphs._host[1].numpy(), graphs._device[1]

    def step(tables: list[list[int]], planted: int | None = None) -> None:
        rows, size = len(tables), graphs.size_for(len(tables))
        graphs._fill([5] * rows, [4 * len(t) - 1 for t in tables], tables, size)
        for row, table in enumerate(tables):
            expected = [33, *table[1:]] if row == planted else table
            assert device[row, : len(table)].tolist() == expected, row
        assert device[rows:size, 0].tolist() == [SCRATCH] * (size - rows)
        assert graphs.cache.zeroed_blocks >= 1 + max(max(t) for t in tables)

    a, b, c = [0, 1], [2], [3, 4, 5]
    step([a, b, c])  # size 4: one padding row
    host[0, 0] = 33  # planted: row 0 keeps list `a`, so it is not rewritten
    b.append(6)
    step([a, b, c], planted=0)
    assert host[1, :2].tolist() == [2, 6]
    host[0, 0] = 0  # `a` as it is
    replaced = [7, 8]  # `a` after a preemption: a new list, the same length
    step([replaced, b, c])
    step([b, c])  # rows shift: row 0 now holds `b`, row 1 `c`
    step([c, b, [9], [10, 11, 12]])  # a longer table into a shorter one's row and back
    host[1, 0] = 33
    step([c])  # one row: rows 1.. are left out, not padding
    step([c, b], planted=1)  # row 1 was left holding `b`: it still does, not rewritten


def test_the_engine_samples_plain_greedy_steps_from_the_graphs_pick(tiny_model, monkeypatch):
    """Greedy requests through the graphs' buffers, one asking for logprobs only and one for the top 3 at
    each token: generate()'s tokens, the logprobs and top 3 those of transformers' logits; the graphs'
    steps took the graph's pick (sent to the host), with the top 3 where the top-N row was in the step, and
    none of their rows was sampled from the logits."""
    made = graphs_on_the_test_device(monkeypatch).made
    calls: list[tuple] = []  # in order: ("sampled", rows sampled from the logits), ("sent", rows, top_n)
    original = eager_sampling.sample_rows

    def recording(logits, rows):  # noqa: ANN001, ANN202 - sample_rows'
        calls.append(("sampled", len(rows)))
        return original(logits, rows)

    monkeypatch.setattr(eager_sampling, "sample_rows", recording)
    engine = create_engine(tiny_model, EngineConfig(max_prefill_tokens=8))
    graphs = engine.runner.graphs
    send_pick = graphs.send_pick

    def recording_send(logits, sampled=False, top_n=0):  # noqa: ANN001, ANN202 - DecodeGraphs.send_pick's
        receive = send_pick(logits, sampled, top_n)
        if receive is not None:
            calls.append(("sent", len(logits), top_n))
        return receive

    graphs.send_pick = recording_send  # type: ignore[method-assign]

    async def one(prompt: str, top_n: int, tokens: int) -> list:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True, top_n_tokens=top_n)
        return [e async for e in engine.generate(GenerationRequest(prompt, params)) if e.token]

    async def both() -> list[list]:
        engine.start()
        try:
            return await asyncio.gather(one(PROMPTS[0], 0, 12), one(PROMPTS[1], 3, 4))
        finally:
            await engine.stop()

    plain, top = asyncio.run(both())
    assert made and ("sent", 1, 0) in calls  # the plain row's steps alone: the graph's pick
    both_rows = [n for n, call in enumerate(calls) if call == ("sent", 2, 3)]  # graph steps of both rows
    assert len(both_rows) >= 2 and all(calls[n + 1 : n + 2] != [("sampled", 1)] for n in both_rows), calls
    assert not [c for c in calls if c[0] == "sampled" and c[1] == 1], calls  # (the prompt steps': both rows)
    for prompt, events in ((PROMPTS[0], plain), (PROMPTS[1], top)):
        tokens = [e.token.id for e in events]
        assert tokens == greedy_tokens(tiny_model, prompt, len(tokens)), prompt
        ids = torch.tensor([tiny_model.tokenizer(prompt).input_ids + tokens], device=tiny_model.model.device)
        with torch.inference_mode():
            reference = tiny_model.model(ids).logits[0, -len(tokens) - 1 : -1].float().log_softmax(-1)
        expected = reference.gather(1, torch.tensor(tokens, device=ids.device)[:, None])[:, 0].tolist()
        assert [e.token.logprob for e in events] == pytest.approx(expected, abs=1e-4), prompt
        if events is top:
            best, best_ids = reference.topk(3)
            assert [[t.id for t in e.top_tokens] for e in events] == best_ids.tolist()
            ours = [t.logprob for e in events for t in e.top_tokens]
            assert ours == pytest.approx(best.flatten().tolist(), abs=1e-4)


def test_the_write_index_is_the_caches_row_layout():
    """`token_rows` (numpy, on the host) gives the rows `paged.flat_index` (torch) gives."""
    from lmiserve.engine.attention.paged import flat_index
    from lmiserve.engine.attention.triton_ops import token_rows

    blocks, positions = [3, 0, 7, 7], [13, 2, 28, 31]
    expected = flat_index(torch.tensor(blocks), torch.tensor(positions) % 4, 2, 4).reshape(-1)
    assert token_rows(blocks, positions, 2, 4).tolist() == expected.tolist()


async def test_overlapped_steps_chain_on_the_device_and_give_generates_tokens(tiny_model, monkeypatch):
    """Overlap scheduling with the graphs: a step of plain greedy rows is launched with its tokens in
    flight, the next step takes them as its rows' inputs on the device (chained) before the first is
    collected. Requests join and leave meanwhile: one ends at a stop token nobody could foresee (its row in
    the chained step computed in vain), one asks for the top 2 (its steps sample on the host, so the step
    after them is not chained). Every request's tokens are generate()'s; nothing stays in flight."""
    record = graphs_on_the_test_device(monkeypatch)
    engine = create_engine(tiny_model, EngineConfig(max_running=6, max_prefill_tokens=8, async_scheduling=True))
    runner = engine.runner
    expected = [greedy_tokens(tiny_model, prompt, 12) for prompt in PROMPTS[:4]]
    stop = expected[1][4]  # request 1 ends at its 5th token (or before, where it comes earlier)
    cut = expected[1].index(stop) + 1

    async def one(i: int, after: int, tokens: int = 12, **params: object) -> list[int]:
        while engine.steps < after:  # later requests join a running batch
            await asyncio.sleep(0.001)
        params = {"max_new_tokens": tokens, "ignore_eos_token": True, **params}
        request = GenerationRequest(PROMPTS[i], SamplingParams(**params))  # type: ignore[arg-type]
        return [e.token.id async for e in engine.generate(request) if e.token]

    engine.start()
    try:
        results = await asyncio.gather(
            one(0, 0), one(1, 0, stop_token_ids=[stop]), one(2, 4, 3, top_n_tokens=2), one(3, 9)
        )
    finally:
        await engine.stop()
    assert results == [expected[0], expected[1][:cut], expected[2][:3], expected[3]]
    assert record.chained > 0 and engine.steps_ahead > 0
    assert runner.in_flight.last is None  # every launched step was collected
