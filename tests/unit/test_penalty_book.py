"""The penalties' book (engine/runner/penalties.py): a runner's penalized requests' tokens as dense device rows,
which give the same penalized logits, bit for bit, as the (row, token) pairs of the requests' lists, on both of
its paths (a GPU's ops over the whole rows, a CPU's over the pairs they mark), as the requests' tokens grow, as
slots are reused and as the book grows; and an engine's penalized requests sample what they sampled from the
lists."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from helpers.engines import running_engine
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.runner import penalties, request_state
from lmiserve.engine.runner.penalties import FIRST_SLOTS, BookedRow, PenaltyBook
from lmiserve.engine.runner.sampling import Row, _processed_rows

VOCAB = 3000

KINDS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
    SamplingParams(),  # (no penalty: never booked)
    SamplingParams(presence_penalty=-1.5, logit_bias={5: 2.0}),
    SamplingParams(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, min_new_tokens=50),
]


def _rows(rng: random.Random, count: int) -> list[Row]:
    return [
        Row(
            KINDS[n % len(KINDS)],
            [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 200))],
            [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 40))],
            [0, 1],
        )
        for n in range(count)
    ]


def _booked(rows: list[Row], book: PenaltyBook) -> list[Row]:
    """The same requests (their own lists, shared), penalized from `book`."""
    out = []
    for row in rows:
        twin = Row(row.params, row.prompt_ids, row.output_ids, row.banned_ids)
        if penalties.penalized(row.params):
            twin.penalty = BookedRow(book, book.open(row.prompt_ids, row.output_ids))
        out.append(twin)
    return out


def _logits(rng: random.Random, count: int) -> torch.Tensor:
    logits = torch.randn((count, VOCAB), generator=torch.Generator().manual_seed(rng.randrange(1000))) * 6
    logits[0, :10] = float("inf")
    logits[1, :10] = float("-inf")
    logits[2, 3] = float("nan")
    return logits


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.fixture(params=["pairs", "dense"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Either of the book's paths on this CPU: its own (the pairs the rows mark), or a GPU's (whole rows)."""
    if request.param == "dense":
        monkeypatch.setattr(penalties, "_dense", lambda device: True)
    return str(request.param)


def test_the_book_penalizes_as_the_lists_do_bit_for_bit_step_after_step(path: str):
    rng = random.Random(1)
    rows = _rows(rng, 24)
    book = PenaltyBook()
    booked = _booked(rows, book)
    for _ in range(6):
        logits = _logits(rng, len(rows))
        for where in (list(range(len(rows))), [3, 7, 11, 0, 5], [2]):  # a step's rows, some of them, one
            assert torch.equal(
                _bits(_processed_rows(logits, booked, where)), _bits(_processed_rows(logits, rows, where))
            )
        for row in rows:  # each request's token of the step (repeats too), and now and then more
            row.output_ids.extend(
                rng.choice([[rng.randrange(VOCAB)], [row.output_ids[-1]] if row.output_ids else [], []])
            )
    assert book.slots == (32 if path == "dense" else 0)  # (dense: 20 rows penalized, 8 rows, then 16, then 32)


def test_a_reused_slot_starts_clear_and_the_book_is_let_go_when_every_request_closed(path: str):
    rng = random.Random(2)
    book = PenaltyBook()
    first = _booked(_rows(rng, 3), book)
    logits = _logits(rng, 3)
    _processed_rows(logits, first, [0, 1, 2])
    assert first[0].penalty is not None
    book.close(first[0].penalty.slot)
    later = _rows(rng, 1)  # a new request takes the freed slot: none of the old one's tokens are its
    (again,) = _booked(later, book)
    assert again.penalty is not None and again.penalty.slot == first[0].penalty.slot
    assert torch.equal(_bits(_processed_rows(logits, [again], [0])), _bits(_processed_rows(logits, later, [0])))
    for row in [again, *first[1:]]:
        assert row.penalty is not None
        book.close(row.penalty.slot)
    assert len(book) == 0 and book.slots == 0 and book.seen is None and book.counts is None


def test_growing_keeps_every_open_request_s_rows(path: str):
    rng = random.Random(3)
    rows = [r for r in _rows(rng, 40) if penalties.penalized(r.params)][: FIRST_SLOTS + 1]
    book = PenaltyBook()
    booked = _booked(rows[:FIRST_SLOTS], book)
    logits = _logits(rng, len(rows))
    _processed_rows(logits, booked, list(range(FIRST_SLOTS)))
    assert book.slots == (FIRST_SLOTS if path == "dense" else 0)
    booked += _booked(rows[FIRST_SLOTS:], book)  # one more than it holds: it doubles
    where = list(range(len(rows)))
    assert torch.equal(_bits(_processed_rows(logits, booked, where)), _bits(_processed_rows(logits, rows, where)))
    assert book.slots == (2 * FIRST_SLOTS if path == "dense" else 0)


def test_ids_past_the_logits_are_left_out(path: str):
    """A prompt id the logits have no column for (a tokenizer's added token past the model's vocabulary)
    marks nothing, as it penalizes nothing."""
    book = PenaltyBook()
    row = Row(SamplingParams(repetition_penalty=2.0), [1, VOCAB + 5], [2], [])
    row.penalty = BookedRow(book, book.open(row.prompt_ids, row.output_ids))
    logits = torch.ones((1, VOCAB))
    out = _processed_rows(logits, [row], [0])[0]
    assert out[:4].tolist() == [1.0, 0.5, 0.5, 1.0] and int((out != 1.0).sum()) == 2


# --- an engine's penalized requests ------------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Deep learning is a subfield of", "Numbers 1, 2, 3"]
ENGINE_PARAMS = [
    SamplingParams(max_new_tokens=14, repetition_penalty=1.4, ignore_eos_token=True),
    SamplingParams(max_new_tokens=9, do_sample=True, seed=3, presence_penalty=1.2, frequency_penalty=0.6),
    SamplingParams(max_new_tokens=12, ignore_eos_token=True),
    SamplingParams(max_new_tokens=11, do_sample=True, seed=8, temperature=0.7, repetition_penalty=1.2, top_n_tokens=3),
    SamplingParams(max_new_tokens=7, frequency_penalty=1.5, ignore_eos_token=True),
]


async def _engine_outputs(loaded) -> tuple[list[list[tuple[int, float]]], int]:  # noqa: ANN001
    async with running_engine(loaded, max_running=3) as engine:  # (10 requests through 3 rows: slots reused)

        async def one(i: int) -> list[tuple[int, float]]:
            params = ENGINE_PARAMS[i % len(ENGINE_PARAMS)]
            events = [e async for e in engine.generate(GenerationRequest(PROMPTS[i % len(PROMPTS)], params))]
            return [(e.token.id, e.token.logprob) for e in events if e.token is not None]

        outputs = await asyncio.gather(*(one(i) for i in range(10)))
        for _ in range(200):  # the runner is told of the last requests' end by the engine's next step
            if len(engine.runner.penalties) == 0:
                break
            await asyncio.sleep(0.01)
        return list(outputs), len(engine.runner.penalties)


async def test_an_engine_s_penalized_requests_sample_what_the_lists_sampled(tiny_model, monkeypatch, path: str):
    booked, slots = await _engine_outputs(tiny_model)
    assert slots == 0  # every request finished: every slot closed
    monkeypatch.setattr(request_state, "penalized", lambda params: False)  # no book: the lists
    lists, _ = await _engine_outputs(tiny_model)
    assert [[t for t, _ in out] for out in booked] == [[t for t, _ in out] for out in lists]
    # (the logprobs are the raw logits', whose last bits follow how the two runs batched the prompts)
    assert [lp for out in booked for _, lp in out] == pytest.approx([lp for out in lists for _, lp in out], abs=1e-4)
    assert [len(tokens) for tokens in booked] == [p.max_new_tokens for p in ENGINE_PARAMS] * 2
