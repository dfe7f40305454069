"""Tensor parallelism's engine (issue #25): the tiny model split over two CPU worker processes (gloo)
gives the tokens of the whole model in one process: greedy rows, a seeded sampled row (every rank samples
the same gathered logits, rank 0 answers), a prompt long enough for chunked prefill, prompt logprobs and
top tokens; with KV heads split (2 over 2 ranks) and replicated (1 KV head on both ranks), and for a tiny
Qwen3 (its heads' norms), a tiny Granite (its multipliers) and a tiny Seed-OSS (biases on every linear); and
prompt
lookup (ngram) speculative decoding on top.

Each configuration's engines run once per module (a start spawns two workers, ~4 s on two cores); the
tests compare what they answered."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.tiny_model import build_tiny_model_dir
from lmiserve.config import Settings
from lmiserve.core.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration

LONG_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs back home. " * 5
PROMPTS = ["Hello world", "The quick brown fox", "Numbers like 1, 2, 3", "once upon a time", LONG_PROMPT]
NEW_TOKENS = 16
LOGPROB_TOL = 1e-4  # the ranks' partial sums add in another order than the whole model's products


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[int]]
    top_logprobs: list[list[float]]
    prefill: list[tuple[int, float | None]]
    prefill_ranks: tuple | None
    prefill_top: list[list[int] | None] | None
    finish: str
    generated_text: str
    cached_tokens: int = 0


def requests() -> list[GenerationRequest]:
    greedy = [
        GenerationRequest(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos_token=True, top_n_tokens=3))
        for p in PROMPTS
    ]
    seeded = GenerationRequest(
        "Sampling with a seed",
        SamplingParams(
            max_new_tokens=NEW_TOKENS, ignore_eos_token=True, do_sample=True, seed=1234, temperature=0.9, top_k=50
        ),
    )
    logprobs = GenerationRequest(
        "Prompt logprobs, please",
        SamplingParams(max_new_tokens=4, decoder_input_details=True, prompt_top_n=3, top_n_tokens=2),
    )
    return [*greedy, seeded, logprobs]


async def _collect(engine, request: GenerationRequest) -> Answer:
    tokens, logprobs, top, top_lp = [], [], [], []
    finish = None
    async for event in engine.generate(request):
        if event.token is not None:
            tokens.append(event.token.id)
            logprobs.append(event.token.logprob)
        if event.top_tokens:
            top.append([t.id for t in event.top_tokens])
            top_lp.append([t.logprob for t in event.top_tokens])
        if event.finish is not None:
            finish = event.finish
    assert finish is not None and finish.error is None, finish
    return Answer(
        tokens,
        logprobs,
        top,
        top_lp,
        [(t.id, t.logprob) for t in finish.prefill or ()],
        finish.prefill_ranks,
        [None if tops is None else [t.id for t in tops] for tops in finish.prefill_top]
        if finish.prefill_top is not None
        else None,
        str(finish.reason),
        finish.generated_text,
        finish.cached_tokens,
    )


SPECULATION: dict[str, dict] = {}  # the speculative engines' `describe()` after their requests, by model name


async def _run(engine) -> list[Answer]:
    engine.start()
    try:  # all at once: one batch of rows at different stages (the long prompt's chunks beside decodes)
        answers = list(await asyncio.gather(*(_collect(engine, r) for r in requests())))
        if engine.speculation is not None:
            SPECULATION["tp"] = engine.speculation.describe()
        return answers
    finally:
        await engine.stop()


def _answers(model_dir: Path, degree: int, **options: str) -> list[Answer]:
    from lmiserve.models.compose import build_engine, build_tensor_parallel_engine
    from lmiserve.models.load import load_causal_lm, load_model_shell

    # a small prefill budget: the long prompt is prefilled in chunks, beside the other rows' decodes
    base = {"model_id": str(model_dir), "device": "cpu", "max_rolling_batch_prefill_tokens": "16", **options}
    if degree == 1:
        quantize, load_format = options.get("quantize"), options.get("load_format", "auto")
        loaded = load_causal_lm(model_dir, device="cpu", quantize=quantize, load_format=load_format)
        engine = build_engine(loaded, Settings.from_options(base))
    else:
        settings = Settings.from_options({**base, "tensor_parallel_degree": str(degree)})
        engine = build_tensor_parallel_engine(load_model_shell(model_dir, device="cpu"), settings, degree)
    return asyncio.run(_run(engine))


@pytest.fixture(scope="module")
def kv1_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with one KV head (replicated on both ranks)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-kv1") / "tiny-kv1", kv_heads=1)


@pytest.fixture(scope="module")
def kv2_answers(tiny_model_dir: Path) -> tuple[list[Answer], list[Answer]]:
    return _answers(tiny_model_dir, 1), _answers(tiny_model_dir, 2)


@pytest.fixture(scope="module")
def kv1_answers(kv1_model_dir: Path) -> tuple[list[Answer], list[Answer]]:
    return _answers(kv1_model_dir, 1), _answers(kv1_model_dir, 2)


@pytest.fixture(scope="module")
def variant_answers(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[list[Answer], list[Answer]]]:
    """One process's answers and two ranks' for a tiny model of an architecture of tests/helpers/llama_variants.py
    (its 4 heads and 2 KV heads split over the two ranks), each made once a module."""
    from helpers.llama_variants import ARCHS, build
    from helpers.tiny_model import build_tiny_tokenizer

    made: dict[str, tuple[list[Answer], list[Answer]]] = {}

    def answers_of(arch: str) -> tuple[list[Answer], list[Answer]]:
        if arch not in made:
            out = tmp_path_factory.mktemp(arch) / arch
            build(*ARCHS[arch]).save_pretrained(out)
            build_tiny_tokenizer().save_pretrained(out)
            made[arch] = _answers(out, 1), _answers(out, 2)
        return made[arch]

    return answers_of


# qwen3: an RMS norm over each query and key head, heads wider than hidden / heads; granite: its multipliers (the
# embeddings' after each rank's share is gathered, the residual branches' after their all-reduce); seed_oss_bias:
# biases on q/k/v (split with their rows) and on o and down (added by one rank); gemma3_window: the norms of
# attention's and the MLP's outputs (after their all-reduce), two RoPE tables, the logits' soft cap; exaone4_window:
# no norms of the layers' inputs, no RoPE on the full layer; phi3_window: q/k/v and gate/up one linear each (each
# rank's runs of rows of each read from the checkpoint); starcoder2_window: c_fc and c_proj split as gate and down,
# LayerNorms' biases on every rank, c_proj's bias added by one; phi4_mini_longrope: 3/4 of each head rotated;
# glm4: gate_up_proj by runs, RoPE by pairs; gemma2_window: each rank's heads' scores soft-capped; mixtral,
# qwen2_moe_shared, glm4_moe: mixtures of experts, every expert split, each rank's slices of each expert's matrices
# read from the checkpoint (Mixtral's names; a gated shared expert and a dense layer; GLM-4.5's router biases);
# gpt_oss: each rank's heads' sinks, its experts transposed with gate and up interleaved, their biases; olmo2, olmo3_window, olmoe: RMS norms of the whole q and k projections (each rank its heads' part of the
# weights, the mean of the squares all-reduced; OLMoE's experts split)
@pytest.fixture(
    params=[
        "kv-split",
        "kv-replicated",
        "qwen3",
        "granite",
        "seed_oss_bias",
        "gemma3_window",
        "exaone4_window",
        "phi3_window",
        "starcoder2_window",
        "phi4_mini_longrope",
        "glm4",
        "gemma2_window",
        "mixtral",
        "qwen2_moe_shared",
        "glm4_moe",
        "gpt_oss",
        "olmo2",
        "olmo3_window",
        "olmoe",
    ]
)
def answers(
    request: pytest.FixtureRequest, variant_answers: Callable[[str], tuple[list[Answer], list[Answer]]]
) -> tuple[list[Answer], list[Answer]]:
    kv = {"kv-split": "kv2_answers", "kv-replicated": "kv1_answers"}
    return request.getfixturevalue(kv[request.param]) if request.param in kv else variant_answers(request.param)


def _close(a: list[float | None], b: list[float | None], tol: float = LOGPROB_TOL) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, abs_tol=tol))
        for x, y in zip(a, b, strict=True)
    )


def test_greedy_rows_are_the_whole_models(answers):
    whole, split = answers
    for i, prompt in enumerate(PROMPTS):
        assert split[i].tokens == whole[i].tokens, prompt[:30]
        assert len(split[i].tokens) == NEW_TOKENS
        assert split[i].generated_text == whole[i].generated_text
        assert _close(split[i].logprobs, whole[i].logprobs), (split[i].logprobs, whole[i].logprobs)


def test_the_long_prompt_takes_several_prefill_chunks(tiny_model_dir):
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tiny_model_dir)(LONG_PROMPT)["input_ids"]) > 3 * 16


def test_a_seeded_sampled_row_is_the_whole_models(answers):
    whole, split = answers
    seeded = len(PROMPTS)
    assert split[seeded].tokens == whole[seeded].tokens
    assert len(set(split[seeded].tokens)) > 1
    assert _close(split[seeded].logprobs, whole[seeded].logprobs)


def test_top_tokens_and_prompt_logprobs_are_the_whole_models(answers):
    whole, split = answers
    for i in range(len(PROMPTS)):
        assert split[i].top == whole[i].top and all(len(t) == 3 for t in split[i].top)
        assert all(_close(a, b) for a, b in zip(split[i].top_logprobs, whole[i].top_logprobs, strict=True))
    last = -1
    assert split[last].prefill and [t for t, _ in split[last].prefill] == [t for t, _ in whole[last].prefill]
    assert _close([lp for _, lp in split[last].prefill], [lp for _, lp in whole[last].prefill])
    assert split[last].prefill_ranks == whole[last].prefill_ranks is not None
    assert split[last].prefill_top == whole[last].prefill_top is not None
    assert split[last].tokens == whole[last].tokens and split[last].top == whole[last].top


NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
    '"disable_by_batch_size": 64, "min_acceptance_rate": 0}'
)


def test_ngram_speculation_under_tensor_parallelism_gives_the_greedy_tokens(tiny_model_dir, kv2_answers):
    """Prompt lookup drafts (repetitive prompts: most steps draft), verified on the two ranks: the same
    greedy tokens as without speculation."""
    whole = kv2_answers[0]
    speculative = _answers(tiny_model_dir, 2, speculative_config=NGRAM)
    for i, prompt in enumerate(PROMPTS):
        assert speculative[i].tokens == whole[i].tokens, prompt[:30]
    drafted = SPECULATION["tp"]
    assert drafted["num_drafts"] > 0, drafted
    assert speculative[-1].prefill and [t for t, _ in speculative[-1].prefill] == [t for t, _ in whole[-1].prefill]


def test_a_draft_model_under_tensor_parallelism_gives_the_greedy_tokens(tiny_model_dir, kv2_answers):
    """A draft model (here the model itself: its drafts are accepted) loaded whole by each rank, which all propose
    the same drafts, verified on the two ranks: the greedy tokens without speculation, most steps' drafts taken."""
    draft = (
        f'{{"method": "draft_model", "model": "{tiny_model_dir}", "num_speculative_tokens": 3, '
        '"disable_by_batch_size": 64, "min_acceptance_rate": 0}'
    )
    whole = kv2_answers[0]
    speculative = _answers(tiny_model_dir, 2, speculative_config=draft)
    for i, prompt in enumerate(PROMPTS):
        assert speculative[i].tokens == whole[i].tokens, prompt[:30]
    drafted = SPECULATION["tp"]
    assert drafted["num_drafts"] > 0 and drafted["num_accepted_tokens"] > drafted["num_drafts"], drafted


CACHED: dict[str, int] = {}  # prompt tokens the prefix cache supplied to the second round, by executor


def _constrained_and_cached(engine) -> list[list[int]]:
    """A JSON-schema-constrained request and a regex one beside free ones, then the same prompts again
    (their prefix blocks now cached): every answer's tokens, in order."""
    from lmiserve.core.grammar import Grammar

    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    shared = "A shared system prompt that fills two blocks of the cache. "
    questions = ["Hello there", "The quick brown fox", "Once upon a time"]

    def batch() -> list[GenerationRequest]:
        free = [
            GenerationRequest(shared + p, SamplingParams(max_new_tokens=12, ignore_eos_token=True)) for p in questions
        ]
        return [
            *free,
            GenerationRequest(
                shared + "JSON:", SamplingParams(max_new_tokens=16, grammar=Grammar("json_schema", schema))
            ),
            GenerationRequest(
                shared + "Digits:", SamplingParams(max_new_tokens=6, grammar=Grammar("regex", "[0-9]{3}"))
            ),
        ]

    async def run() -> list[list[int]]:
        engine.start()
        try:
            first = await asyncio.gather(*(_collect(engine, r) for r in batch()))
            again = await asyncio.gather(*(_collect(engine, r) for r in batch()))
            CACHED[engine.executor.__class__.__name__] = sum(a.cached_tokens for a in again)
            return [a.tokens for a in (*first, *again)]
        finally:
            await engine.stop()

    return asyncio.run(run())


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_structured_output_and_the_prefix_cache_under_tensor_parallelism(tiny_model_dir, overlap):
    """The grammar bitmask travels in the batch to every rank, and the prefix cache's blocks (computed by
    every rank for its heads) are read again: the same tokens as one process, the constrained ones
    matching their grammar. With overlap scheduling, a step planned ahead goes out with its constrained
    rows held by every rank, and their masks follow in a second message once the step before is applied
    (`Executor.sample_masked`): the same tokens, and steps planned and sent ahead while grammars run."""
    from lmiserve.models.compose import build_engine, build_tensor_parallel_engine
    from lmiserve.models.load import load_causal_lm, load_model_shell

    base = {"model_id": str(tiny_model_dir), "device": "cpu", "enable_prefix_caching": "true"}
    whole = _constrained_and_cached(
        build_engine(load_causal_lm(tiny_model_dir, device="cpu"), Settings.from_options(base))
    )
    settings = Settings.from_options({**base, "tensor_parallel_degree": "2", "async_scheduling": str(overlap).lower()})
    engine = build_tensor_parallel_engine(load_model_shell(tiny_model_dir, device="cpu"), settings, 2)
    parallel = _constrained_and_cached(engine)
    assert parallel == whole
    assert (engine.steps_ahead > engine.steps // 2) is overlap, (engine.steps_ahead, engine.steps)
    assert (engine.executor.sent_ahead > 0) is overlap  # (sent before the step before them was answered)
    tokenizer = load_model_shell(tiny_model_dir, device="cpu").tokenizer
    n = 3  # the free questions
    assert "n" in json.loads(tokenizer.decode(parallel[n]))
    assert re.fullmatch(r"[0-9]{3}", tokenizer.decode(parallel[n + 1]))
    assert parallel[: n + 2] == parallel[n + 2 :]  # greedy: the cached run answers as the first did
    assert CACHED["TensorParallelExecutor"] == CACHED["InProcessExecutor"] > 0, CACHED


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_preemption_under_tensor_parallelism_keeps_every_stream(tiny_model_dir, kv2_answers, overlap):
    """A pool of 12 blocks of 4 tokens on each rank (its KV heads' half of every block) for the whole
    burst: the scheduler preempts, the ranks drop the preempted requests' blocks and recompute them when
    they come back, and every greedy stream is the one of an unhurried single process; with overlap
    scheduling too (each rank takes a pending row's token from its own persistent batch)."""
    from lmiserve.engine.core.kv_blocks import bytes_per_block
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    rank_block = bytes_per_block(layers=2, kv_heads=1, head_dim=16, dtype_bytes=4, block_size=4)
    options = {
        "model_id": str(tiny_model_dir),
        "device": "cpu",
        "max_rolling_batch_prefill_tokens": "16",
        "block_size": "4",
        "kv_cache_memory_bytes": str(12 * rank_block),
        "tensor_parallel_degree": "2",
        "async_scheduling": str(overlap).lower(),
    }
    engine = build_tensor_parallel_engine(
        load_model_shell(tiny_model_dir, device="cpu"), Settings.from_options(options), 2
    )
    assert engine.pool is not None and engine.pool.num_blocks == 12
    greedy = [
        GenerationRequest(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos_token=True)) for p in PROMPTS[:4]
    ]

    async def run() -> tuple[list[Answer], int]:
        engine.start()
        try:
            answers = await asyncio.gather(*(_collect(engine, r) for r in greedy))
            return list(answers), engine.snapshot().preemptions
        finally:
            await engine.stop()

    answers, preemptions = asyncio.run(run())
    assert preemptions > 0
    assert (engine.steps_ahead > 0) is overlap
    for answer, whole in zip(answers, kv2_answers[0]):
        assert answer.tokens == whole.tokens


# ---- LoRA adapters over the ranks (issue #36) -----------------------------------------------------------------

LORA_TOKENS = 12
LORA_PROMPTS = ["Hello there, how are", "def add(a, b):", "one two three four"]


def test_lora_adapters_over_two_ranks_give_the_merged_models_tokens(tiny_model_dir, lora_adapter_dirs):
    """A TP=2 server's model (`lora_modules` at start, through `ModelService` as `lmiserve serve` loads it):
    each rank reads its shard of an adapter when a step first names a load of it, and the greedy tokens of
    every adapter, and of the base model, alone and all in one batch, are `generate()`'s with the adapter
    merged by PEFT. With ``max_cpu_loras=2`` and three adapters the leader unloads and loads again, and the
    ranks forget what it unloaded."""
    from helpers.lora_adapters import merged_generate
    from lmiserve.models.service import ModelService

    modules = " ".join(f"{name}={path}" for name, path in lora_adapter_dirs.items())
    settings = Settings.from_options(
        {
            "model_id": str(tiny_model_dir),
            "device": "cpu",
            "tensor_parallel_degree": "2",
            "lora_modules": modules,
            "max_loras": "2",
            "max_cpu_loras": "2",
        }
    )
    names = [None, *lora_adapter_dirs]
    service = ModelService(settings)

    async def run():
        await service.load()
        assert service.status == ModelService.READY, service.error
        engine = service.engine
        assert engine.adapters is not None and sorted(engine.adapters.names()) == sorted(lora_adapter_dirs)
        assert engine.adapters.loaded_count() == 2  # the third was unloaded at start
        ids = [service.loaded.tokenizer(p)["input_ids"] for p in LORA_PROMPTS]

        async def one(i: int, name: str | None) -> list[int]:
            params = SamplingParams(max_new_tokens=LORA_TOKENS, ignore_eos_token=True)
            request = GenerationRequest("", params, prompt_ids=ids[i], adapter=name)
            return [e.token.id async for e in engine.generate(request) if e.token is not None]

        try:
            alone = {(name, 0): await one(0, name) for name in names}
            jobs = [(name, i) for i in range(len(ids)) for name in names]
            mixed = dict(zip(jobs, await asyncio.gather(*(one(i, name) for name, i in jobs)), strict=True))
            return ids, alone, mixed
        finally:
            await service.close()

    ids, alone, mixed = asyncio.run(run())
    expected = {
        name: merged_generate(tiny_model_dir, lora_adapter_dirs[name] if name else None, ids, LORA_TOKENS)
        for name in names
    }
    assert len({tuple(expected[name][0]) for name in names}) == len(names)  # every adapter changes the output
    for (name, i), tokens in [*alone.items(), *mixed.items()]:
        assert tokens == expected[name][i], (name, i)


def _served(options: dict[str, str], names: list[str | None]) -> tuple[list[list[int]], dict]:
    """What a server of `options` (its model loaded as `lmiserve serve` loads it) answers for each adapter of `names`
    (None: the base model) and each of LORA_PROMPTS, all at once: the prompts' ids and the greedy tokens by
    ``(name, prompt index)``."""
    from lmiserve.models.service import ModelService

    service = ModelService(Settings.from_options({"device": "cpu", **options}))

    async def run():
        await service.load()
        assert service.status == ModelService.READY, service.error
        ids = [service.loaded.tokenizer(p)["input_ids"] for p in LORA_PROMPTS]

        async def one(prompt: list[int], name: str | None) -> list[int]:
            params = SamplingParams(max_new_tokens=LORA_TOKENS, ignore_eos_token=True)
            request = GenerationRequest("", params, prompt_ids=prompt, adapter=name)
            return [e.token.id async for e in service.engine.generate(request) if e.token is not None]

        try:
            jobs = [(name, i) for i in range(len(ids)) for name in names]
            return ids, dict(zip(jobs, await asyncio.gather(*(one(ids[i], name) for name, i in jobs)), strict=True))
        finally:
            await service.close()

    return asyncio.run(run())


def test_an_attention_adapter_on_a_mixture_of_experts_over_two_ranks(tmp_path):
    """A Qwen3-MoE split over two ranks (every expert cut) serving an adapter of its attention: the greedy tokens of
    the adapter and of the base model are `generate()`'s with the adapter merged by PEFT."""
    from helpers.llama_variants import MOE_ARCHS, build
    from helpers.lora_adapters import AdapterSpec, make_adapter, merged_generate
    from helpers.tiny_model import build_tiny_tokenizer

    base = tmp_path / "qwen3_moe"
    build(*MOE_ARCHS["qwen3_moe"]).save_pretrained(base)
    build_tiny_tokenizer().save_pretrained(base)
    adapter = make_adapter(base, tmp_path / "attn", AdapterSpec("attn", 8, ("q_proj", "v_proj"), seed=4, b_std=0.3))
    options = {"model_id": str(base), "tensor_parallel_degree": "2", "lora_modules": f"attn={adapter}"}
    ids, served = _served(options, [None, "attn"])
    expected = {
        None: merged_generate(base, None, ids, LORA_TOKENS),
        "attn": merged_generate(base, adapter, ids, LORA_TOKENS),
    }
    assert expected[None] != expected["attn"]  # the adapter changes the output
    for (name, i), tokens in served.items():
        assert tokens == expected[name][i], (name, i)


def test_an_adapter_on_an_awq_checkpoint_over_two_ranks_gives_one_processs_tokens(tmp_path):
    """An AWQ checkpoint over two ranks (each rank's int4 linears cut from the checkpoint) serving an adapter of
    column- and row-parallel linears (q, v, o, down): the base model's and the adapter's greedy tokens are those
    one process serves from the same checkpoint with the same adapter."""
    from helpers.lora_adapters import AdapterSpec, make_adapter
    from helpers.quantizable import quantizable_llama, write_checkpoint

    model = quantizable_llama(25)
    float_dir = write_checkpoint(model, tmp_path / "float", "float")
    awq_dir = write_checkpoint(model, tmp_path / "awq", "awq")
    spec = AdapterSpec("all", 8, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=4, b_std=0.3)
    adapter = make_adapter(float_dir, tmp_path / "all", spec)
    options = {"model_id": str(awq_dir), "lora_modules": f"all={adapter}"}
    _, one = _served(options, [None, "all"])
    _, two = _served({**options, "tensor_parallel_degree": "2"}, [None, "all"])
    assert one[(None, 0)] != one[("all", 0)]  # the adapter changes the output
    assert two == one


def test_gpt_oss_from_its_mxfp4_checkpoint_over_two_ranks(tmp_path):
    """gpt-oss's MXFP4 checkpoint over two ranks, each reading its part of every expert (kept MXFP4 on the CPU's f4
    kernel, as the whole model in one process keeps them): the tokens and logprobs of the model in one process."""
    from helpers.mxfp4 import write_mxfp4_gpt_oss

    folder = tmp_path / "gpt-oss-mxfp4"
    write_mxfp4_gpt_oss(folder)
    whole, split = _answers(folder, 1), _answers(folder, 2)
    for one, two in zip(whole, split, strict=True):
        assert one.tokens == two.tokens
        assert _close(one.logprobs, two.logprobs)


# fp8-channel: each rank's rows of the fp8 weights with their scales; fp8-block-moe: a Qwen3-MoE in block-wise fp8,
# its experts' slices dequantized through the blocks they cover (blocks of 16, a rank's 24 rows of 48 are not
# whole blocks); awq: each rank's codes on the CPU int4 kernel; gptq-desc-act: act-order groups; fp8-at-load:
# quantize=fp8 on a float checkpoint, each rank's shard quantized per channel (a row-parallel linear's scales over
# whole rows); awq-dummy: a benchmark's 4-bit model of random weights, each rank's shard rounded to codes
QUANTIZED = {
    "fp8-channel": ("fp8-channel", 128, False, {}),
    "fp8-block-moe": ("fp8-block", 16, False, {}),
    "awq-moe": ("awq", 16, False, {}),  # a Qwen3-MoE's experts in AWQ's codes too: each rank's slices de-quantized
    "awq": ("awq", 128, False, {}),
    "awq-inside-group": ("awq", 128, False, {}),  # down_proj's 384 inputs: rank 1's 192 start inside a group of 128
    "gptq-desc-act": ("gptq", 64, True, {}),
    "gptq-int8": ("gptq-int8", 64, False, {}),  # 8-bit codes, four a word: a rank's rows or its words' inputs
    "w4a16-asym": ("w4a16-asym", 32, False, {}),  # compressed-tensors' pack-quantized, written by the package
    "w8a8": ("w8a8", 0, False, {}),  # compressed-tensors' int-quantized int8
    "fp8-at-load": ("float", 0, False, {"quantize": "fp8"}),
    "fp8-at-load-moe": ("float", 0, False, {"quantize": "fp8"}),  # (experts kept fp8: a rank's 24 inputs of down, 32)
    "awq-dummy": ("float", 0, False, {"quantize": "awq", "load_format": "dummy"}),
    "modelopt-fp8-block": ("modelopt-fp8-block", 0, False, {}),  # NVIDIA ModelOpt's FP8_PB_WO, written by its export
}


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_a_quantized_checkpoint_over_two_ranks_gives_the_tokens_of_one_process(tmp_path, case):
    """A quantized checkpoint split over two ranks, each making its shard's layers from the checkpoint's tensors:
    the tokens and logprobs of the same checkpoint loaded whole in one process."""
    from helpers.llama_variants import MOE_ARCHS, build
    from helpers.quantizable import quantizable_llama, write_checkpoint

    fmt, group, act_order, options = QUANTIZED[case]
    intermediate = 384 if case.endswith("inside-group") else 512  # (read by groups of 64 there: `whole_groups`)
    model = build(*MOE_ARCHS["qwen3_moe"]) if case.endswith("moe") else quantizable_llama(25, intermediate=intermediate)
    folder = write_checkpoint(model, tmp_path / case, fmt, group, act_order)
    whole, split = _answers(folder, 1, **options), _answers(folder, 2, **options)
    for one, two in zip(whole, split, strict=True):
        assert one.tokens == two.tokens
        assert _close(one.logprobs, two.logprobs)


def test_quantize_fp8_per_tensor_over_two_ranks_gives_the_tokens_of_one_process(tmp_path, monkeypatch):
    """``quantize=fp8`` per tensor (as on a GPU with fp8 products; ``LMISERVE_FP8_PER_TENSOR=1`` here): each rank's
    part of a linear takes the whole weight's one scale (the ranks' maxima all-reduced), so two ranks give the
    tokens and logprobs of one process; and not quite those of per-channel scales (the option is in use)."""
    from helpers.quantizable import quantizable_llama, write_checkpoint
    from lmiserve.engine.model import fp8_ops

    folder = write_checkpoint(quantizable_llama(25), tmp_path / "float", "float", 0, False)
    per_channel = _answers(folder, 1, quantize="fp8")
    monkeypatch.setenv("LMISERVE_FP8_PER_TENSOR", "1")  # the workers read it as they start
    monkeypatch.setattr(fp8_ops, "PER_TENSOR", True)
    whole, split = _answers(folder, 1, quantize="fp8"), _answers(folder, 2, quantize="fp8")
    for one, two in zip(whole, split, strict=True):
        assert one.tokens == two.tokens
        assert _close(one.logprobs, two.logprobs)
    assert [a.logprobs for a in whole] != [a.logprobs for a in per_channel]


@pytest.mark.parametrize("kv", ["fp8", "bfloat16"])
def test_a_narrower_kv_cache_over_two_ranks_gives_one_processs_tokens(tiny_model_dir, kv2_answers, kv):
    """``kv_cache_dtype=fp8`` (or ``bfloat16``) over two ranks, each rank's pool its KV heads' keys and values in fp8
    (bf16): the tokens and logprobs of one process with the same cache (and not quite the fp32 cache's: the cache is
    in use). In fp8 the ranks' partial sums, an ulp of fp32 off the whole model's, can round a key to the next fp8
    value (an eighth apart), which moves a logprob by about 1e-3 (measured: 8e-4 on the long prompt; the fp8 cache
    moves them from the fp32 cache's by 0.15 to 3)."""
    whole, split = _answers(tiny_model_dir, 1, kv_cache_dtype=kv), _answers(tiny_model_dir, 2, kv_cache_dtype=kv)
    for one, two in zip(whole, split, strict=True):
        assert one.tokens == two.tokens
        assert _close(one.logprobs, two.logprobs, 5e-3 if kv == "fp8" else LOGPROB_TOL)
    assert [a.logprobs for a in whole] != [a.logprobs for a in kv2_answers[0]]  # the narrower cache is in use
