"""A GPU step's sampled rows drawn in one kernel, each from its seed and the index of its token
(engine/runner/seeded_draw.py): here under Triton's interpreter on a CPU (tests/conftest.py sets
TRITON_INTERPRET), compiled on the GPU check's device (LMISERVE_TEST_DEVICE). The kernel is called directly
(`seeded_draw.draw_keyed`), or the sampler and the engine are made to take it on a CPU (`usable`)."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from helpers.capture_hazards import Hazards, watch
from helpers.engines import running_engine
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.runner import sampling, seeded_draw
from lmiserve.engine.runner.sampling import _draw, make_generator, sample_rows, sampler_row, warp_rows

pytest.importorskip("triton")

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))


def kernel(probs: torch.Tensor, seeds: list[int], counts: list[int]) -> tuple[list[int], list[bool]]:
    keys = torch.tensor(seeded_draw.seed_keys(seeds), device=DEVICE)
    tokens, undrawable = seeded_draw.draw_keyed(probs.to(DEVICE), keys, torch.tensor(counts, device=DEVICE))
    return tokens.tolist(), undrawable.tolist()


@pytest.mark.parametrize(
    ("row", "limit"),
    [
        # a likely token beside ten unlikely ones (the variates multiplied instead of divided: it takes 0.75)
        (torch.tensor([0.5] + [0.05] * 10 + [0.0] * 5), 37.7),
        # a flat row over the four quarters of a block (a quarter given another's variates: never drawn)
        (torch.full((16,), 1 / 16), 44.3),
    ],
    ids=["peaked", "flat"],
)
def test_each_token_is_drawn_as_often_as_its_probability(row, limit):
    """300 draws of one row (one seed, the indexes 0..299; then 300 seeds at index 0), one launch each: the
    counts pass Pearson's chi-squared test against the probabilities (p above 0.0001: the statistic below
    `limit` for the row's tokens), and a token of probability 0 is never drawn."""
    draws = 300
    for seeds, counts in (([7] * draws, list(range(draws))), (list(range(draws)), [0] * draws)):
        tokens, undrawable = kernel(row.repeat(draws, 1), seeds, counts)
        assert not any(undrawable)
        assert all(row[t] > 0 for t in tokens)
        chi2 = sum((tokens.count(t) - draws * p) ** 2 / (draws * p) for t, p in enumerate(row.tolist()) if p > 0)
        assert chi2 < limit, chi2


def test_a_draw_depends_on_its_seed_and_index_alone(monkeypatch):
    """The same token for a row alone, in a step of others, and with the vocabulary cut into more or fewer
    parts; a seed taken modulo 2**64 as `torch.Generator.manual_seed` takes it."""
    probs = torch.rand(9, 3000, generator=torch.Generator().manual_seed(0)).pow(8).softmax(-1)
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**70 + 5, 12345, 5, 99]
    counts = [0, 1, 2, 3, 4, 5, 1000, 7, 2**31 + 1]
    together, _ = kernel(probs, seeds, counts)
    alone = [kernel(probs[j : j + 1], [seeds[j]], [counts[j]])[0][0] for j in range(9)]
    assert together == alone
    monkeypatch.setattr(seeded_draw, "_PROGRAMS", 1)  # one part a row: the whole vocabulary in one program
    assert kernel(probs, seeds, counts)[0] == together
    assert kernel(probs[5:6], [5], [5])[0] == kernel(probs[5:6], [2**64 + 5], [5])[0]  # 2**70 + 5 is not 5


def test_draws_move_on_with_the_index_and_differ_by_seed():
    """A flat row of 1,000 tokens: 50 indexes of one seed draw many tokens, and two seeds other sequences."""
    flat = torch.full((50, 1000), 1e-3)
    first, _ = kernel(flat, [1] * 50, list(range(50)))
    second, _ = kernel(flat, [2] * 50, list(range(50)))
    assert len(set(first)) > 40 and len(set(second)) > 40
    assert first != second


def test_a_row_that_cannot_be_drawn_from_is_flagged_and_one_hot_rows_draw_their_token():
    """`sampling._draw`'s rule: a NaN, an inf, a value below 0 or nothing above 0 flags the row; each row is
    flagged alone. A one-hot row draws its token, in any part of the vocabulary."""
    vocab = 2500
    rows = torch.zeros(7, vocab)
    rows[0, 3], rows[0, 7] = float("nan"), 0.5
    rows[2, 10], rows[2, 11] = -0.1, 1.1
    rows[3, 12] = float("inf")
    for j, token in ((4, 0), (5, 1500), (6, vocab - 1)):
        rows[j, token] = 1.0
    tokens, undrawable = kernel(rows, [3] * 7, [0] * 7)
    assert undrawable == [True, True, True, True, False, False, False]
    assert tokens[4:] == [0, 1500, vocab - 1]


@pytest.fixture
def drawn_by_the_kernel(monkeypatch):
    """The sampler on a CPU as on a GPU: the rows at once, drawn by the kernel (a GPU's own choice there)."""
    monkeypatch.setattr(sampling, "_at_once", lambda device: True)
    monkeypatch.setattr(seeded_draw, "usable", lambda device: True)


def _rows(options: list[dict], produced: list[int], first: int = 0) -> list:
    """Rows of these options with `produced` tokens each, seeded 100 + their index (from `first`)."""
    return [
        sampler_row(SamplingParams(**o), [1, 2, 3], [4] * n, [0], seed=100 + first + j, generator=None, device=DEVICE)
        for j, (o, n) in enumerate(zip(options, produced))
    ]


def test_a_steps_sampled_rows_are_the_kernels_draws_of_their_warped_rows(drawn_by_the_kernel):
    """Each sampled row's token is the kernel's draw from its warped probabilities, at its seed and at the
    index of its token (the tokens it has); greedy rows are still the argmax; one wait, the step's one
    transfer; and a row's token is the same in a step of its own."""
    options = [
        {"do_sample": True, "temperature": 0.7},
        {},
        {"do_sample": True, "top_p": 0.8, "top_k": 40},
        {"do_sample": True, "typical_p": 0.9, "min_p": 0.02},
    ]
    produced = [0, 3, 17, 5]
    logits = torch.randn(4, 600, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 3
    hazards = Hazards()
    with torch.inference_mode():
        results = watch(hazards, sample_rows, logits, _rows(options, produced))
    assert [what for what, _ in hazards.syncs] == ["tolist"]
    sampled = [0, 2, 3]
    params = [SamplingParams(**options[j]) for j in sampled]
    probs = warp_rows(logits[sampled], params).softmax(-1)
    expected, _ = kernel(probs, [100 + j for j in sampled], [produced[j] for j in sampled])
    assert [results[j].token_id for j in sampled] == expected  # type: ignore[union-attr]
    assert results[1].token_id == int(logits[1].argmax())  # type: ignore[union-attr]
    for j in sampled:
        alone = sample_rows(logits[j : j + 1], _rows([options[j]], [produced[j]], first=j))[0]
        assert alone.token_id == results[j].token_id  # type: ignore[union-attr]


def test_a_kernel_that_fails_is_logged_once_and_the_generators_draw(drawn_by_the_kernel, monkeypatch, caplog):
    """A Triton that cannot build the kernel: logged, the device marked, and the rows drawn by `_draw` with
    their generators (multinomial's tokens) from then on."""
    monkeypatch.setattr(seeded_draw, "_failed", set())
    monkeypatch.setattr(seeded_draw, "usable", lambda device: str(device) not in seeded_draw._failed)

    def broken() -> None:
        raise RuntimeError("the kernel does not compile here")

    monkeypatch.setattr(seeded_draw, "_kernel", broken)
    options = [{"do_sample": True}, {"do_sample": True, "top_k": 20}]
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with caplog.at_level(logging.ERROR, logger="lmiserve.engine.runner.seeded_draw"):
        first = sample_rows(logits, _rows(options, [0, 0]))
    assert "draw kernel failed" in caplog.text and seeded_draw._failed == {str(logits.device)}
    params = [SamplingParams(**o) for o in options]
    probs = warp_rows(logits, params).softmax(-1)
    expected, _ = _draw(probs, [make_generator(100 + j, DEVICE) for j in range(2)])
    assert [r.token_id for r in first] == expected.tolist()  # type: ignore[union-attr]


async def _tokens(engine, request: GenerationRequest) -> list[int]:
    return [e.token.id async for e in engine.generate(request) if e.token is not None]


async def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_with_drafts(
    tiny_model, drawn_by_the_kernel
):
    """Through the engine with the kernel drawing: a seeded request's tokens alone, among other requests
    (greedy, sampled, unseeded), and with drafts verified (each draft position drawn at its own index) are
    the same; another seed draws others."""
    params = {"do_sample": True, "temperature": 1.2, "top_k": 50, "max_new_tokens": 12, "ignore_eos_token": True}
    request = GenerationRequest("The quick brown fox", SamplingParams(**params, seed=1234))
    async with running_engine(tiny_model) as engine:
        alone = await _tokens(engine, request)
        crowd = await asyncio.gather(
            _tokens(engine, GenerationRequest("Hello world", SamplingParams(max_new_tokens=12))),
            _tokens(engine, GenerationRequest("naïve café", SamplingParams(**params, seed=7))),
            _tokens(engine, request),
            _tokens(engine, GenerationRequest("Numbers like 1, 2", SamplingParams(**params))),
        )
        other = await _tokens(engine, GenerationRequest(request.prompt, SamplingParams(**params, seed=99)))
    echo = lambda seq: (seq.prompt_ids + seq.output_ids)[-4:]  # noqa: E731 - drafts, mostly wrong
    async with running_engine(tiny_model, echo) as engine:
        drafted = await _tokens(engine, request)
    assert len(alone) == 12
    assert crowd[2] == alone and drafted == alone
    assert other != alone
