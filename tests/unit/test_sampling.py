"""Logits processing and sampling on small random logits (CPU, seeded)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from lmiserve.core.request import SamplingParams
from lmiserve.engine.core.step import SampleResult
from lmiserve.engine.runner.sampling import (
    Row,
    _processed,
    make_generator,
    needs_processing,
    sample_row,
    sample_rows,
    warp,
)

VOCAB = 32
CPU = torch.device("cpu")


def logits_row(seed: int = 0, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def sample(logits, params, prompt=(), output=(), banned=(), gen=None):
    return sample_row(logits, params, list(prompt), list(output), list(banned), gen)


def draws(logits, params, n, seed=0) -> list[int]:
    gen = make_generator(seed, CPU)
    return [sample(logits, params, gen=gen).token_id for _ in range(n)]


def apply_penalties(logits, params, prompt_ids, output_ids) -> torch.Tensor:
    """A row's processing (engine/runner/sampling.py `_processed`) with penalties alone set."""
    return _processed(logits, Row(params, list(prompt_ids), list(output_ids), []))


def kept(processed: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(processed)).flatten().tolist())


# --- greedy and seeds --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax_and_reports_the_models_logprob(seed: int):
    logits = logits_row(seed)
    result = sample(logits, SamplingParams())
    assert result.token_id == int(logits.argmax())
    assert result.logprob == pytest.approx(float(logits.log_softmax(-1)[result.token_id]))
    assert result.top is None


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = logits_row(1, scale=0.5)  # flat enough that draws vary
    params = SamplingParams(do_sample=True)
    a = draws(logits, params, 50, seed=42)
    assert a == draws(logits, params, 50, seed=42)
    b = draws(logits, params, 50, seed=43)
    assert a != b
    assert len(set(a)) > 5


def test_a_generator_seeded_per_sequence_does_not_depend_on_the_global_rng():
    logits = logits_row(2, scale=0.5)
    params = SamplingParams(do_sample=True)
    torch.manual_seed(1)
    a = draws(logits, params, 20, seed=7)
    torch.manual_seed(2)
    torch.rand(100)
    assert a == draws(logits, params, 20, seed=7)


def test_top_k_one_equals_greedy():
    for seed in range(10):
        logits = logits_row(seed)
        assert set(draws(logits, SamplingParams(do_sample=True, top_k=1), 20, seed)) == {int(logits.argmax())}


def test_tiny_top_p_keeps_only_the_top_token():
    for seed in range(10):
        logits = logits_row(seed)
        params = SamplingParams(do_sample=True, top_p=1e-6)
        assert kept(warp(logits.clone(), params)) == {int(logits.argmax())}
        assert set(draws(logits, params, 20, seed)) == {int(logits.argmax())}


def test_min_p_removes_tokens_below_a_fraction_of_the_top_probability():
    logits = logits_row(3)
    probs = logits.softmax(-1)
    params = SamplingParams(do_sample=True, min_p=0.2)
    expected = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert 1 < len(expected) < VOCAB
    assert kept(warp(logits.clone(), params)) == expected
    assert set(draws(logits, params, 300)) <= expected


@pytest.mark.parametrize("typical_p", [1e-6, 0.01, 0.2, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.1, 2.0, 20.0])
def test_typical_p_keeps_at_least_one_token(typical_p: float, scale: float):
    for seed in range(5):
        logits = logits_row(seed, scale=scale)
        processed = warp(logits.clone(), SamplingParams(do_sample=True, typical_p=typical_p))
        assert len(kept(processed)) >= 1
        result = sample(logits, SamplingParams(do_sample=True, typical_p=typical_p), gen=make_generator(seed, CPU))
        assert result.token_id in kept(processed)


def test_typical_p_close_to_one_does_not_fail():
    # typical_p=0.99999999 is a valid mass (< 1) but rounds to 1.0 in float32, while the cumulative
    # probability of all tokens usually sums to just below 1.0: then every token counts as "below the
    # mass", the cut-off index equals the vocabulary size and `sorted_shift[last]` raises IndexError.
    # transformers clamps that index (TypicalLogitsWarper: last_ind.clamp_(max=vocab - 1)) and keeps all.
    params = SamplingParams(do_sample=True, typical_p=0.99999999)
    for seed in range(10):
        logits = logits_row(seed, vocab=512, scale=3.0)
        processed = warp(logits.clone(), params)  # IndexError: index 512 is out of bounds
        assert logits.softmax(-1)[sorted(kept(processed))].sum() > 0.9999, seed
        result = sample(logits, params, gen=make_generator(seed, CPU))
        assert result.token_id in kept(processed)


def test_temperature_sharpens_or_flattens_the_distribution():
    logits = logits_row(4, scale=1.0)
    top = int(logits.argmax())
    share = {}
    for temperature in (0.5, 1.0, 2.0):
        counts = Counter(draws(logits, SamplingParams(do_sample=True, temperature=temperature), 3000, seed=5))
        share[temperature] = counts[top] / 3000
        expected = float((logits / temperature).softmax(-1)[top])
        assert share[temperature] == pytest.approx(expected, abs=0.04)
    assert share[0.5] > share[1.0] + 0.05 > share[2.0] + 0.1


def test_temperature_does_not_change_greedy_or_the_reported_logprob():
    logits = logits_row(5)
    greedy = sample(logits, SamplingParams(temperature=0.3))
    assert greedy.token_id == int(logits.argmax())
    sampled = sample(logits, SamplingParams(do_sample=True, temperature=0.3), gen=make_generator(0, CPU))
    assert sampled.logprob == pytest.approx(float(logits.log_softmax(-1)[sampled.token_id]))


# --- penalties ------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), params, prompt_ids=[0, 1], output_ids=[1, 2])
    assert out.tolist() == [1.0, -4.0, 0.5, -1.0, 0.5]  # tokens 0, 1 (prompt) and 2 (output) penalised once


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = logits_row(6)
    prompt, output = [3, 5, 5, 7], [7, 9, 3]
    ours = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=1.3), prompt, output)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


def test_greedy_with_repetition_penalty_avoids_the_repeated_token():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    result = sample(logits, SamplingParams(repetition_penalty=1.5), prompt=[0])
    assert result.token_id == 1
    assert result.logprob == pytest.approx(float(logits.log_softmax(-1)[1]))  # raw distribution


def test_presence_and_frequency_penalties_apply_to_generated_tokens_only():
    logits = torch.zeros(6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), params, prompt_ids=[4, 5], output_ids=[1, 2, 2, 2])
    assert out.tolist() == [0.0, -0.75, -1.25, 0.0, 0.0, 0.0]
    assert apply_penalties(logits.clone(), params, [4, 5], []).tolist() == [0.0] * 6


def test_penalties_do_not_modify_the_callers_logits():
    logits = logits_row(7)
    before = logits.clone()
    sample(logits, SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, min_new_tokens=3), [1, 2], [3], [0])
    assert torch.equal(logits, before)


def test_min_new_tokens_bans_the_given_ids_until_enough_tokens():
    logits = torch.tensor([5.0, 1.0, 0.5, 4.0])  # 0 ("EOS") is the argmax, 3 (a stop id) next
    params = SamplingParams(min_new_tokens=2)
    assert sample(logits, params, output=[], banned=[0, 3]).token_id == 1
    assert sample(logits, params, output=[1], banned=[0, 3]).token_id == 1
    assert sample(logits, params, output=[1, 1], banned=[0, 3]).token_id == 0
    sampled = SamplingParams(do_sample=True, min_new_tokens=2)
    gen = make_generator(0, CPU)
    assert not {sample(logits, sampled, output=[], banned=[0, 3], gen=gen).token_id for _ in range(200)} & {0, 3}


def test_needs_processing():
    assert not needs_processing(SamplingParams())
    assert not needs_processing(SamplingParams(temperature=0.5, top_k=3))  # greedy ignores warpers
    for kw in (
        {"do_sample": True},
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.1},
        {"frequency_penalty": 0.1},
        {"min_new_tokens": 1},
        {"logit_bias": {1: 1.0}},
        {"bad_words_ids": [[1]]},
    ):
        assert needs_processing(SamplingParams(**kw))


def test_openai_penalties_are_additive_per_count_and_presence():
    """OpenAI: logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0); negative
    values encourage repetition."""
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    params = SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)
    out = apply_penalties(logits.clone(), params, prompt_ids=[3, 3], output_ids=[0, 2, 2])
    assert out.tolist() == pytest.approx([1.0 - 1.5 + 1.0, 2.0, -1.0 - 3.0 + 1.0, 0.5])


def test_logit_bias_is_added_before_greedy_and_sampling_and_logprobs_stay_raw():
    logits = torch.tensor([3.0, 1.0, 0.0, 2.0])
    biased = SamplingParams(logit_bias={2: 100.0})
    result = sample(logits, biased)
    assert result.token_id == 2 and result.logprob == pytest.approx(float(logits.log_softmax(-1)[2]))
    assert sample(logits, SamplingParams(logit_bias={0: -100.0})).token_id == 3
    sampled = SamplingParams(do_sample=True, logit_bias={1: 100.0})
    assert set(draws(logits, sampled, 100)) == {1}
    banned = SamplingParams(do_sample=True, logit_bias={0: -100.0, 3: -100.0})
    assert not set(draws(logits, banned, 200)) & {0, 3}


def test_bad_words_ban_one_token_words_always_and_the_last_token_after_the_others():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, 1.0])
    params = SamplingParams(bad_words_ids=[[1], [2, 3]])
    assert sample(logits, params, output=[]).token_id == 2
    assert sample(logits, params, output=[4, 2]).token_id == 2  # 3 after 2 is banned, 1 always
    params = SamplingParams(bad_words_ids=[[2, 3]], logit_bias={1: -10.0, 2: -10.0})
    assert sample(logits, params, output=[2]).token_id == 4
    assert sample(logits, params, output=[4]).token_id == 3


def test_min_p_and_top_k_with_openai_penalties():
    logits = torch.tensor([2.0, 1.9, 0.0, -3.0])
    params = SamplingParams(do_sample=True, top_k=2, frequency_penalty=2.0)
    # token 0 generated twice: 2.0 - 4.0 drops it out of the top 2
    gen = make_generator(0, CPU)
    assert {sample(logits, params, output=[0, 0], gen=gen).token_id for _ in range(100)} == {1, 2}
    params = SamplingParams(do_sample=True, min_p=0.5)
    assert set(draws(logits, params, 200)) == {0, 1}


def test_a_seed_past_the_64_bit_range_wraps():
    logits = logits_row(1, scale=0.5)
    params = SamplingParams(do_sample=True)
    assert draws(logits, params, 20, seed=2**64 + 3) == draws(logits, params, 20, seed=3)


# --- logprobs ------------------------------------------------------------------------------------------


def test_top_n_tokens_are_sorted_logprobs_of_the_raw_distribution():
    logits = logits_row(8)
    result = sample(
        logits, SamplingParams(top_n_tokens=5, do_sample=True, temperature=0.7, top_k=3), gen=make_generator(1, CPU)
    )
    logprobs = logits.log_softmax(-1)
    assert len(result.top) == 5
    values = [lp for _, lp in result.top]
    assert values == sorted(values, reverse=True)
    expected_ids = torch.topk(logprobs, 5).indices.tolist()
    assert [i for i, _ in result.top] == expected_ids
    for token_id, lp in result.top:
        assert lp == pytest.approx(float(logprobs[token_id]))
    assert result.logprob == pytest.approx(float(logprobs[result.token_id]))


def test_top_n_tokens_larger_than_vocab():
    logits = logits_row(9, vocab=4)
    result = sample(logits, SamplingParams(top_n_tokens=10))
    assert len(result.top) == 4
    assert math.fsum(math.exp(lp) for _, lp in result.top) == pytest.approx(1.0)


# --- the same warpers as transformers --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "warpers"),
    [
        (SamplingParams(do_sample=True, temperature=0.7), [TemperatureLogitsWarper(0.7)]),
        (SamplingParams(do_sample=True, top_k=5), [TopKLogitsWarper(5)]),
        (SamplingParams(do_sample=True, top_p=0.7), [TopPLogitsWarper(0.7)]),
        (SamplingParams(do_sample=True, min_p=0.1), [MinPLogitsWarper(0.1)]),
        (SamplingParams(do_sample=True, typical_p=0.6), [TypicalLogitsWarper(0.6)]),
        (
            SamplingParams(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
            [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), TopPLogitsWarper(0.9)],
        ),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "typical_p", "temp+top_k+top_p"],
)
def test_each_warper_matches_transformers(params, warpers):
    for seed in range(20):
        logits = logits_row(seed)
        ours = warp(logits.clone(), params)
        theirs = LogitsProcessorList(warpers)(None, logits[None].clone())[0]
        assert kept(ours) == kept(theirs), seed
        torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_min_p_and_typical_p_apply_in_transformers_order():
    # sampling.warp documents "temperature, top_k, top_p, typical_p, min_p (in the order transformers
    # applies them)"; transformers (GenerationMixin._get_logits_processor) applies min_p BEFORE typical_p.
    # The two do not commute: typical_p may drop the top token, which changes min_p's threshold.
    params = SamplingParams(do_sample=True, typical_p=0.5, min_p=0.3)
    mismatches = []
    for seed in range(50):
        logits = logits_row(seed)
        ours = warp(logits.clone(), params)
        theirs = LogitsProcessorList([MinPLogitsWarper(0.3), TypicalLogitsWarper(0.5)])(None, logits[None].clone())[0]
        if kept(ours) != kept(theirs):
            mismatches.append(seed)
    assert mismatches == []


# --- the batched sampler: a step's rows together ---------------------------------------------------------


def _mixed_rows(vocab: int = VOCAB) -> tuple[torch.Tensor, list[Row]]:
    """Eight rows of every kind: plain greedy, greedy with top-N, penalised, biased, sampled (seeded),
    masked (a grammar's copy), min_new_tokens, sampled with top-N."""
    logits = torch.stack([logits_row(seed) for seed in range(8)])
    masked = logits[5].clone()
    masked[: vocab // 2] = float("-inf")
    rows = [
        Row(SamplingParams(), [1, 2], [3], []),
        Row(SamplingParams(top_n_tokens=3), [1], [], []),
        Row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), [4, 5], [6, 6], []),
        Row(SamplingParams(logit_bias={7: 50.0}), [], [], []),
        Row(SamplingParams(do_sample=True, temperature=0.8, top_k=5), [], [], [], make_generator(11, CPU)),
        Row(SamplingParams(), [], [], [], masked=masked),
        Row(SamplingParams(min_new_tokens=2), [], [], [int(logits[6].argmax())]),
        Row(SamplingParams(do_sample=True, top_n_tokens=5), [], [], [], make_generator(12, CPU)),
    ]
    return logits, rows


def test_sample_rows_equals_each_row_sampled_alone():
    logits, rows = _mixed_rows()
    together = sample_rows(logits, rows)
    _, again = _mixed_rows()  # fresh generators, the same seeds
    alone = [sample_rows(logits[i][None], [row])[0] for i, row in enumerate(again)]
    assert together == alone
    assert together[3].token_id == 7  # the bias wins
    assert together[5].token_id >= VOCAB // 2  # the mask holds
    assert together[6].token_id != int(logits[6].argmax())  # banned before min_new_tokens
    assert [t for t, _ in together[1].top or []] == torch.topk(logits[1], 3).indices.tolist()
    assert together[0].top is None and len(together[7].top or []) == 5


def test_a_seeded_row_samples_the_same_tokens_whatever_else_is_in_the_step():
    logits, rows = _mixed_rows()
    generator = make_generator(99, CPU)
    sampled = Row(SamplingParams(do_sample=True), [], [], [], generator)
    with_others = [sample_rows(logits, [*rows[:4], sampled, *rows[5:]])[4].token_id for _ in range(20)]
    generator.manual_seed(99)
    alone = [sample_rows(logits[4][None], [sampled])[0].token_id for _ in range(20)]
    assert with_others == alone


def test_a_row_that_fails_gets_its_exception_and_the_others_are_sampled():
    logits, rows = _mixed_rows()
    rows[2] = Row(SamplingParams(logit_bias={VOCAB + 5: 1.0}), [], [], [])  # an id past the vocabulary
    results = sample_rows(logits, rows)
    assert isinstance(results[2], IndexError)
    assert all(isinstance(r, SampleResult) for i, r in enumerate(results) if i != 2)
    assert isinstance(results[0], SampleResult) and results[0].token_id == int(logits[0].argmax())


# --- a CPU's top_p (a real vocabulary: more than the 8,192 tokens its candidates look at) ------------------


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0, 8.0], ids=["flat", "spread", "peaked", "sharp"])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_from_the_likeliest_tokens_keeps_what_transformers_keeps(scale, top_p):
    """On a CPU top_p looks at the likeliest 256, then 8,192 tokens before it sorts the vocabulary (the sort
    costs ~5 ms a token at 49,152 tokens): the warped logits are transformers' `TopPLogitsWarper`'s bit for
    bit (so a seed draws the same token as with the sort), whether the nucleus holds a few tokens,
    thousands or most of the vocabulary (then the sort itself)."""
    warper = TopPLogitsWarper(top_p)
    for seed in range(5):
        logits = logits_row(seed, vocab=49152, scale=scale)
        ours = warp(logits.clone(), SamplingParams(do_sample=True, top_p=top_p))
        theirs = warper(None, logits[None].clone())[0]
        assert kept(ours) == kept(theirs), seed
        assert torch.equal(ours, theirs), seed
