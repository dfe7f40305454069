"""Speculative decoding (engine/speculative/proposers.py): each proposer (prompt lookup, a draft model with the
same tokenizer, the target quantized to int4 as its own draft) leaves the output unchanged: greedy
token for token, alone and eight at once, on both paged runners; seeded sampling draw for draw; and
sampled tokens keep the target's distribution (a goodness-of-fit test against the model's own
probabilities). The policy turns drafting down for a large batch and for a request whose drafts are
rarely accepted; the counters count what was verified."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.speculative.proposers import SpeculationSettings, ngram_drafts
from lmiserve.models.load import LoadedModel, load_causal_lm

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello world! Hello world! Hello",
    "1, 2, 3, 1, 2, 3, 1, 2",
    "naïve café, naïve café",
    "abc abc abc abc",
    "To be or not to be, to be or not",
    "red green blue red green",
    "x",
]
TOKENS = 32


def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert ngram_drafts([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    # the longest n first: [5, 1, 2] matches at 4, so [9] follows it, not [3, 4] after the shorter [1, 2]
    assert ngram_drafts([1, 2, 3, 4, 5, 1, 2, 9, 5, 1, 2], 3, 1, 3) == [9, 5, 1]
    assert ngram_drafts([7, 1, 7, 2, 7], 1, 1, 1) == [2]  # the latest occurrence
    assert ngram_drafts([1, 2, 3], 4, 1, 3) == []
    assert ngram_drafts([1, 2, 1], 4, 2, 3) == []  # no 2-gram repeats
    assert ngram_drafts([5], 4, 1, 3) == []


@pytest.fixture(scope="module")
def int4_draft(tiny_model_dir, tiny_model) -> LoadedModel:
    """The tiny model quantized to int4 (CPU only): the self-draft."""
    if tiny_model.device.type != "cpu":
        pytest.skip("int4 runs on CPU")
    return load_causal_lm(tiny_model_dir, dtype="int4", device="cpu")


@pytest.fixture(scope="module")
def other_draft(tiny_model_dir, tiny_model) -> LoadedModel:
    """A different model with the same tokenizer: the tiny model with its weights perturbed."""
    loaded = load_causal_lm(tiny_model_dir, dtype="fp32", device=str(tiny_model.device))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in loaded.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param.device) * param.std() * 0.1)
    return loaded


SPECS = {
    "ngram": (SpeculationSettings("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3), None),
    "draft_model": (SpeculationSettings("draft_model", 3), "other_draft"),
    "self_draft_int4": (SpeculationSettings("draft_model", 5), "int4_draft"),
}


@pytest.fixture(params=list(SPECS))
def speculation(request) -> tuple[str, SpeculationSettings, LoadedModel | None]:
    spec, draft = SPECS[request.param]
    return request.param, spec, request.getfixturevalue(draft) if draft else None


@contextlib.asynccontextmanager
async def engine_with(loaded, spec=None, draft=None, **config):
    engine = create_engine(loaded, EngineConfig(speculation=spec, **config), draft=draft)
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def tokens(engine: AsyncEngine, request: GenerationRequest) -> list[int]:
    return [e.token.id async for e in engine.generate(request) if e.token is not None]


def greedy(**params) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": TOKENS, "ignore_eos_token": True, **params})


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
async def test_greedy_output_is_unchanged_alone_and_eight_at_once(tiny_model, speculation, fast_path):
    name, spec, draft = speculation
    requests = [GenerationRequest(p, greedy()) for p in PROMPTS]
    async with engine_with(tiny_model, fast_path=fast_path) as engine:
        expected = [await tokens(engine, r) for r in requests]
    spec = dataclasses.replace(spec, disable_by_batch_size=8)
    async with engine_with(tiny_model, spec, draft, fast_path=fast_path) as engine:
        alone = [await tokens(engine, r) for r in requests]
        steps = engine.steps
        together = await asyncio.gather(*(tokens(engine, r) for r in requests))
        info = engine.snapshot().speculation
    assert alone == expected
    assert together == expected
    assert info is not None and info["num_drafts"] > 0 and info["num_accepted_tokens"] > 0, info
    assert 0 < info["acceptance_rate"] <= 1
    assert sum(info["accepted_per_position"]) == info["num_accepted_tokens"]
    if name == "self_draft_int4":
        # the int4 copy agrees with the fp32 model on most tokens: fewer steps than tokens (this random
        # model's near-uniform logits make it disagree more often than a trained model's int4 copy)
        assert steps < len(PROMPTS) * TOKENS * 0.75, (steps, info)


async def test_stop_strings_max_new_tokens_logprobs_and_penalties_are_unchanged(tiny_model, other_draft):
    cases = [
        greedy(max_new_tokens=7),
        greedy(stop_sequences=["o"]),
        greedy(top_n_tokens=3),
        greedy(repetition_penalty=1.3),
        greedy(frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(max_new_tokens=TOKENS),  # EOS may end it
        greedy(min_new_tokens=5, max_new_tokens=9),
    ]
    requests = [GenerationRequest(p, params) for p in PROMPTS[:3] for params in cases]

    async def events(engine):
        return [
            [
                (e.token.id, e.token.logprob, e.top_tokens, e.finish and e.finish.reason)
                async for e in engine.generate(r)
                if e.token is not None or e.finish is not None
            ]
            for r in requests
        ]

    async with engine_with(tiny_model) as engine:
        expected = await events(engine)
    async with engine_with(
        tiny_model, SpeculationSettings("draft_model", 4, disable_by_batch_size=64), other_draft
    ) as engine:
        got = await events(engine)
        assert engine.snapshot().speculation["num_drafts"] > 0
    assert [[e[0] for e in seq] for seq in got] == [[e[0] for e in seq] for seq in expected]
    assert [[e[3] for e in seq] for seq in got] == [[e[3] for e in seq] for seq in expected]
    for got_seq, expected_seq in zip(got, expected, strict=True):
        for a, b in zip(got_seq, expected_seq, strict=True):
            assert a[1] == pytest.approx(b[1], abs=1e-4)
            assert [t.id for t in a[2] or []] == [t.id for t in b[2] or []]


async def test_seeded_sampling_draws_the_same_tokens(tiny_model, speculation):
    _, spec, draft = speculation
    requests = [
        GenerationRequest(p, greedy(do_sample=True, temperature=0.8, top_k=8, seed=100 + i))
        for i, p in enumerate(PROMPTS)
    ]
    async with engine_with(tiny_model) as engine:
        expected = await asyncio.gather(*(tokens(engine, r) for r in requests))
    async with engine_with(tiny_model, dataclasses.replace(spec, disable_by_batch_size=8), draft) as engine:
        got = await asyncio.gather(*(tokens(engine, r) for r in requests))
    assert got == expected


async def test_sampled_tokens_keep_the_models_distribution(tiny_model, other_draft):
    """The first three tokens of many sampled streams (seeds 0..N-1) whose third token is a verified
    draft of another model (a draft model proposes from the step after the prompt), against the model's
    own top-2 distribution: a chi-square goodness of fit over the 8 (first, second, third) triples."""
    prompt = "red green blue red green"
    top_k, samples = 2, 400
    params = [
        SamplingParams(max_new_tokens=4, do_sample=True, top_k=top_k, seed=s, ignore_eos_token=True)
        for s in range(samples)
    ]
    spec = SpeculationSettings("draft_model", 2, disable_by_batch_size=64, min_acceptance_rate=0.0)
    async with engine_with(tiny_model, spec, other_draft, max_running=32) as engine:
        outs = await asyncio.gather(*(tokens(engine, GenerationRequest(prompt, p)) for p in params))
        info = engine.snapshot().speculation
    assert info["num_drafts"] >= samples // 2 and 0 < info["num_accepted_tokens"] < info["num_draft_tokens"], info
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    # the model's own probabilities of each triple, with top-2 filtering as the sampler does
    model, tokenizer = tiny_model.model, tiny_model.tokenizer
    ids = tokenizer(prompt)["input_ids"]

    def top(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float().cpu()
        best = torch.topk(logits, top_k)
        probs = torch.softmax(best.values, -1)
        return dict(zip(best.indices.tolist(), probs.tolist(), strict=True))

    expected = {}
    for first, p1 in top(ids).items():
        for second, p2 in top([*ids, first]).items():
            for third, p3 in top([*ids, first, second]).items():
                expected[(first, second, third)] = p1 * p2 * p3 * samples
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    # 7 degrees of freedom: 24.3 is the 0.999 quantile
    assert chi2 < 24.3, (chi2, counts, expected)


async def test_drafting_turns_down_for_a_large_batch_and_for_rejected_drafts(tiny_model, other_draft):
    spec = SpeculationSettings("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=2)
    requests = [GenerationRequest(p, greedy()) for p in PROMPTS]
    async with engine_with(tiny_model, spec) as engine:
        task = asyncio.gather(*(tokens(engine, r) for r in requests))
        seen = []
        while not task.done():
            seen.append(engine.snapshot().speculation)
            await asyncio.sleep(0.002)
        await task
        await tokens(engine, requests[0])  # alone: drafting again
        alone = engine.snapshot().speculation
    off = [info for info in seen if not info["active"]]
    assert off and "disable_by_batch_size" in off[0]["reason"]
    assert alone["active"] and alone["reason"] is None
    # drafts that are never right: the request stops asking after a few steps
    wrong = SpeculationSettings("ngram", 4, min_acceptance_rate=0.9)
    async with engine_with(tiny_model, wrong) as engine:
        await tokens(engine, GenerationRequest("abc abc abc abc abc abc", greedy(max_new_tokens=64)))
        info = engine.snapshot().speculation
    assert info["num_drafts"] < 32, info


def test_speculation_needs_the_paged_kv_cache(tiny_model):
    with pytest.raises(ValueError, match="draft model"):
        create_engine(tiny_model, EngineConfig(speculation=SpeculationSettings("draft_model", 3)))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"speculative_config": '{"method": "eagle", "model": "x"}'}, "method 'eagle' is not supported"),
        ({"speculative_config": '{"method": "ngram", "foo": 1}'}, "foo: unknown key"),
        ({"speculative_config": '{"method": "ngram"'}, "not a JSON object"),
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 0}'}, "num_speculative_tokens"),
        ({"speculative_config": '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}'}, "larger than"),
        ({"speculative_config": '{"method": "draft_model"}'}, "needs a model"),
        ({"speculative_config": '{"method": "ngram", "dtype": "int4"}'}, "takes no model and no dtype"),
        ({"speculative_config": '{"method": "self_draft", "prompt_lookup_max": 3}'}, "are ngram's"),
        ({"speculative_length": "3"}, "needs speculative_draft_model"),
        ({"speculative_draft_model": "/m", "speculative_config": '{"method": "ngram"}'}, "not both"),
    ],
)
def test_bad_speculative_options_stop_the_start_with_one_clear_line(options, message):
    from lmiserve.config import ConfigError, Settings

    with pytest.raises(ConfigError, match=message):
        Settings.from_options(options)


def test_speculative_options_in_vllms_and_lmis_spellings():
    from lmiserve.config import Settings

    spec = Settings.from_options(
        {"speculative_config": '{"method": "ngram", "prompt_lookup_max": 3}'}
    ).speculative_config
    assert spec is not None and (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 2, 3)
    lmi = Settings.from_options({"speculative_draft_model": "/opt/ml/model/draft"}).speculative_config
    assert lmi is not None and (lmi.method, lmi.model, lmi.num_speculative_tokens) == (
        "draft_model",
        "/opt/ml/model/draft",
        5,
    )
    own = Settings.from_options({"speculative_config": '{"method": "self_draft"}'}).speculative_config
    assert own is not None and own.self_draft and own.dtype == "int4"
    quantized = Settings.from_options(
        {"speculative_config": '{"dtype": "int8", "method": "draft_model"}'}
    ).speculative_config
    assert quantized is not None and quantized.self_draft and quantized.dtype == "int8"


def test_speculative_config_from_serving_properties_and_the_environment(tmp_path):
    from lmiserve.config import load_settings

    properties = tmp_path / "serving.properties"
    properties.write_text(
        'option.speculative_config={"method": "draft_model", "model": "/opt/ml/model/draft", "num_speculative_tokens": 3}\n'
    )
    spec = load_settings({}, properties, None, environ={}).speculative_config
    assert spec is not None and (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model",
        "/opt/ml/model/draft",
        3,
    )
    env = load_settings({}, None, None, environ={"OPTION_SPECULATIVE_CONFIG": '{"method": "self_draft"}'})
    assert env.speculative_config is not None and env.speculative_config.method == "self_draft"
    assert env.sources["speculative_config"] == "environment OPTION_SPECULATIVE_CONFIG"


@pytest.mark.parametrize(
    ("config", "method", "lookup", "draft_name"),
    [
        ('{"method": "ngram", "prompt_lookup_max": 3}', "ngram", (2, 3), None),
        ('{"method": "self_draft"}', "draft_model", (2, 5), "the bundled model as int4"),
        ('{"model": "/m/draft", "dtype": "bf16"}', "draft_model", (2, 5), "/m/draft (bf16)"),
    ],
)
def test_the_engine_reads_each_method_from_the_settings(config, method, lookup, draft_name):
    """What the server builds its engine from (compose.engine_config), for each method."""
    from lmiserve.config import Settings
    from lmiserve.models.compose import engine_config

    spec = engine_config(Settings.from_options({"speculative_config": config})).speculation
    assert spec is not None and spec.method == method and spec.draft_name == draft_name
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == lookup
    assert spec.num_speculative_tokens == 4 and spec.disable_by_batch_size is None  # resolved by the device


def test_the_settings_help_names_the_engines_device_defaults():
    """`disable_by_batch_size` left out is resolved by the engine (factory.DISABLE_BY_BATCH_SIZE, which
    imports no settings); the setting's help says the same numbers."""
    from lmiserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
    from lmiserve.engine.factory import DISABLE_BY_BATCH_SIZE

    assert DISABLE_BY_BATCH_SIZE["cpu"] == DEFAULT_DISABLE_BY_BATCH_SIZE
    help_text = SpeculativeConfig.model_fields["disable_by_batch_size"].description
    assert f"{DISABLE_BY_BATCH_SIZE['cpu']} on CPU, {DISABLE_BY_BATCH_SIZE['cuda']} on a GPU" in (help_text or "")
