"""A step's sampled rows drawn together (engine/runner/sampling.py): the tokens `torch.multinomial` draws
for the same generators, each row as it samples alone, and the host waiting for the device once a step."""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.capture_hazards import Hazards, watch
from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner import sampling
from lmiserve.engine.runner.sampling import Row, _draw, make_generator, sample_rows, warp, warp_rows

# on the GPU check's device too (LMISERVE_TEST_DEVICE): the draw there must be multinomial's as well
DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
CPU = torch.device("cpu")


def _probs(seed: int, vocab: int, scale: float, zeros: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * scale
    logits[torch.randperm(vocab, generator=gen)[:zeros]] = float("-inf")  # tokens a warper removed
    return logits.softmax(-1).to(device)


@pytest.mark.parametrize("vocab", [7, 512, 49152])
def test_the_draw_is_the_token_torch_multinomial_draws_with_the_same_generator(vocab):
    """Row by row and draw after draw (each generator moves on as multinomial moves it), over peaked and
    flat rows and rows with removed tokens."""
    for seed in range(12):
        rows = [
            _probs(seed * 10 + j, vocab, scale, vocab // 3 * (j % 2), DEVICE) for j, scale in enumerate((0.3, 3, 30))
        ]
        ours = [make_generator(1000 + seed * 10 + j, DEVICE) for j in range(3)]
        theirs = [make_generator(1000 + seed * 10 + j, DEVICE) for j in range(3)]
        for _ in range(4):
            tokens, undrawable = _draw(torch.stack(rows), ours)
            expected = [int(torch.multinomial(row, 1, generator=gen)) for row, gen in zip(rows, theirs)]
            assert tokens.tolist() == expected
            assert not undrawable.any()


@pytest.fixture
def two_threads():
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(own)


def test_a_cpus_sampled_rows_on_two_threads_draw_multinomials_tokens(two_threads):
    """On a CPU a step's sampled rows go each alone over the engine's threads (engine/runner/row_threads.py):
    in the engine's inference mode, 32 rows of 49,152 tokens, three steps, the tokens multinomial draws from
    each row's warped distribution with the same generators."""
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(3)) * 3
    options = [OPTIONS[1 + j % 8] for j in range(32)]  # sampled rows, every warper
    ours = [_row(o, j) for j, o in enumerate(options)]
    theirs = [make_generator(j, CPU) for j in range(32)]
    for _ in range(3):
        with torch.inference_mode():
            tokens = [r.token_id for r in sample_rows(logits, ours)]  # type: ignore[union-attr]
        expected = [
            int(torch.multinomial(warp(row, SamplingParams(**o)).softmax(-1), 1, generator=g))
            for row, o, g in zip(logits, options, theirs)
        ]
        assert tokens == expected


@pytest.mark.parametrize("at_once", [False, True], ids=["row by row", "at once"])
def test_a_row_that_cannot_be_drawn_from_is_flagged_and_fails_alone(monkeypatch, at_once):
    """Rows multinomial refuses (a NaN, an inf, a negative value, all zero) are flagged by the draw; in a
    step, such a row gets an error through the one transfer and the other rows their tokens. (The
    warpers keep a token of every row and make the logits finite, so only a fault reaches this.)"""
    nan = float("nan")
    good = _probs(0, 8, 1.0, 0, CPU)
    bad = [good.clone().index_fill_(0, torch.tensor([3]), v) for v in (float("nan"), float("inf"), -0.5)]
    rows = torch.stack([good, *bad, torch.zeros(8), good])
    _, undrawable = _draw(rows, [make_generator(j, CPU) for j in range(len(rows))])
    assert undrawable.tolist() == [False, True, True, True, True, False]

    if at_once:  # the second sampled row made NaN by the step's warpers
        monkeypatch.setattr(sampling, "warp_rows", lambda logits, params: logits.index_fill(0, torch.tensor([1]), nan))
    else:  # by its own
        monkeypatch.setattr(sampling, "warp", lambda row, p: row.fill_(nan) if p.temperature == 0.5 else row)
    monkeypatch.setattr(sampling, "_at_once", lambda device: at_once)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    specs = [_row(o, j) for j, o in enumerate(({"do_sample": True}, {"do_sample": True, "temperature": 0.5}))]
    specs += [_row({"do_sample": True}, 2), _row({}, 3)]
    results = sample_rows(logits, specs)
    assert isinstance(results[1], ValueError) and "no token can be drawn" in str(results[1])
    assert [isinstance(r, Exception) for r in results] == [False, True, False, False]
    assert results[3].token_id == int(logits[3].argmax())


# every option a row may set, alone and together
OPTIONS = [
    {},
    {"do_sample": True},
    {"do_sample": True, "temperature": 0.7},
    {"do_sample": True, "temperature": 1.6, "top_k": 20},
    {"do_sample": True, "top_p": 0.8},
    {"do_sample": True, "temperature": 0.5, "top_k": 50, "top_p": 0.95},
    {"do_sample": True, "min_p": 0.05},
    {"do_sample": True, "typical_p": 0.9},
    {"do_sample": True, "top_k": 5, "min_p": 0.1, "typical_p": 0.8, "top_p": 0.7, "temperature": 0.9},
    {"do_sample": True, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"do_sample": True, "logit_bias": {3: 5.0, 4: -100.0}, "bad_words_ids": [[9], [2, 7]]},
    {"do_sample": True, "min_new_tokens": 10, "top_p": 0.5},
    {"repetition_penalty": 1.5, "top_n_tokens": 3},
    {"do_sample": True, "temperature": 1e-4},
]


def _row(options: dict, seed: int) -> Row:
    return Row(SamplingParams(**options), [1, 2, 3, 2], [7, 2, 2], [0, 5], make_generator(seed, CPU))


@pytest.mark.parametrize("at_once", [False, True], ids=["row by row", "at once"])
@pytest.mark.parametrize("vocab", [512, 12000])
def test_each_row_of_a_step_samples_as_it_would_alone(vocab, at_once, two_threads, monkeypatch):
    """On a CPU, bit for bit: a seeded request samples the same tokens whatever else is in its step (at
    12,000 tokens a CPU's `top_p` goes row by row, at 512 the rows sort together), on both paths: a CPU's
    (each row alone, over two threads) and a GPU's (the rows at once). Rows in random mixes, logits with a
    NaN, an inf and a -inf among them, constrained rows among them, in the engine's inference mode."""
    rng = random.Random(vocab)
    for trial in range(6):
        count = rng.randint(1, 24)
        options = [rng.choice(OPTIONS) for _ in range(count)]
        logits = torch.randn(count, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice((1, 4))
        logits[0, 1], logits[-1, 2], logits[count // 2, 6] = float("nan"), float("inf"), float("-inf")
        # constrained rows: a grammar's mask, and one that allows only the ids `min_new_tokens` bans
        masks = {j: logits[j].masked_fill(torch.rand(vocab) < 0.9, float("-inf")) for j in range(1, count, 4)}
        for j in range(3, count, 7):
            options[j] = {"do_sample": j % 2 == 1, "min_new_tokens": 10, "top_p": 0.5}
            masks[j] = torch.full((vocab,), float("-inf")).index_copy_(0, torch.tensor([0, 5]), logits[j, [0, 5]])

        def rows_of(j: int, o: dict, trial: int = trial, masks: dict = masks) -> Row:
            row = _row(o, trial * 100 + j)
            row.masked = masks.get(j)
            return row

        monkeypatch.setattr(sampling, "_at_once", lambda device: at_once)
        with torch.inference_mode():
            together = sample_rows(logits, [rows_of(j, o) for j, o in enumerate(options)])
        monkeypatch.setattr(sampling, "_at_once", lambda device: False)
        alone = [sample_rows(logits[j : j + 1], [rows_of(j, o)])[0] for j, o in enumerate(options)]
        assert repr(together) == repr(alone), (trial, options)  # (a row with a NaN logit: a NaN logprob)
        for j in range(3, count, 7):  # nothing but the banned ids allowed: the row may end
            assert together[j].token_id in (0, 5)  # type: ignore[union-attr]
        specs = [rows_of(j, o) for j, o in enumerate(options)]
        processed = sampling._processed_rows(logits, specs, list(range(count)))
        for j, row in enumerate(specs):  # the processing itself, bit for bit
            assert torch.equal(processed[j], sampling._processed(logits[j], row)), (trial, options[j])
        params = [SamplingParams(**o) for o in options]
        warped = warp_rows(torch.nan_to_num(logits, nan=float("-inf")), params)
        for row, p, out in zip(torch.nan_to_num(logits, nan=float("-inf")), params, warped):
            assert torch.equal(out, warp(row, p)), (trial, p)


def test_a_steps_sampling_makes_the_host_wait_once(monkeypatch):
    """Every option on the device's path (the rows at once; 4,096 tokens: a CPU's row-by-row `top_p` is
    above 8,192): the host reads the step's one transfer and nothing else (`torch.multinomial` read each
    row's values twice; `torch.unique`, `typical_p`'s cut and the ids' blocking copies read them too)."""
    monkeypatch.setattr(sampling, "_at_once", lambda device: True)
    options = [o for o in OPTIONS if o] * 3
    logits = torch.randn(len(options), 4096, generator=torch.Generator().manual_seed(0))
    rows = [_row(o, j) for j, o in enumerate(options)]
    rows[1].masked = logits[1].clone()  # a constrained row before its min_new_tokens: the guard too
    rows[1].params = SamplingParams(do_sample=True, min_new_tokens=10)
    hazards = Hazards()
    with torch.inference_mode():
        results = watch(hazards, sample_rows, logits, rows)
    assert not any(isinstance(r, Exception) for r in results)
    assert [what for what, _ in hazards.syncs] == ["tolist"], hazards.syncs


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched (on a GPU, each one with a kernel is a launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("every", [1, 3], ids=["every row", "one row in 3"])
def test_a_steps_warpers_launch_as_many_ops_at_8_rows_as_at_64(every):
    """Each warper is one stage for all the rows that set it, `typical_p` included: the ops of a step
    (the GPU's: 4,096 tokens, where `top_p` sorts the rows together) do not grow with its rows, and each
    row, its own masses among them, comes out as it would alone."""
    kinds = [
        {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "typical_p": 0.9},
        {"do_sample": True, "typical_p": 0.5},
        {"do_sample": True, "temperature": 1.3, "typical_p": 0.99},
    ]
    plain = SamplingParams(do_sample=True, temperature=0.7)
    counts = []
    for rows in (8, 64):
        params = [SamplingParams(**kinds[j % 3]) if j % every == 0 else plain for j in range(rows)]
        logits = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(rows)) * 3
        ops = _Ops()
        with ops:
            warped = warp_rows(logits, params)
        counts.append(ops.count)
        for row, p, out in zip(logits, params, warped):
            assert torch.equal(out, warp(row, p)), p
    assert counts[0] == counts[1], counts
