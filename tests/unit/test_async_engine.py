"""AsyncEngine with the real model runners on the tiny random Llama (CPU, fp32).

Greedy output is compared token for token with `model.generate`; the rest checks the request
lifecycle: queue limits, queue timeouts, cancellation, per-request failures, length validation, n/best_of.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from helpers.greedy import greedy_reference
from helpers.waiting import HANG_TIMEOUT
from lmiserve.config import Settings
from lmiserve.core.errors import InvalidRequest, Overloaded, QueueTimeout
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.codecs import prompt_codec
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import PREFILL_FLOOR, create_engine
from lmiserve.engine.pool_plan import kv_pool_blocks
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.engine.runner.generic import PagedGenericRunner
from lmiserve.engine.runner.graph_sampling import GRAPH_TOP_N
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
from lmiserve.models.compose import build_engine

PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you",
    "Deep learning is a subfield of",
    "What is the capital of France? The capital",
    "Numbers like 1, 2, 3",
    "naïve café 日本語 🎉",
]
NEW_TOKENS = 20


# --- helpers -------------------------------------------------------------------------------------------


def make_engine(
    loaded, *, runner_cls: type[PersistentBatchRunner] | None = None, max_input_len=None, **config
) -> AsyncEngine:
    """The engine `create_engine` builds for `config`, or, given `runner_cls` (a test's instrumented
    `PagedFastRunner` or `PagedGenericRunner`), one on a runner of that class over the KV pool
    `create_engine` would size."""
    engine_config = EngineConfig(**config)
    if runner_cls is None:
        return create_engine(loaded, engine_config, max_input_len=max_input_len)
    if engine_config.prefill_floor == "auto":
        floor = PREFILL_FLOOR.get(loaded.device.type, PREFILL_FLOOR["cuda"])
        engine_config = dataclasses.replace(engine_config, prefill_floor=floor)
    pool = {"num_blocks": kv_pool_blocks(loaded, engine_config), "block_size": engine_config.block_size}
    runner: PersistentBatchRunner
    if issubclass(runner_cls, PagedFastRunner):
        runner = runner_cls(
            loaded.model,
            max_slots=engine_config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
            enforce_eager=engine_config.enforce_eager,
            **pool,
        )
    else:
        assert issubclass(runner_cls, PagedGenericRunner)
        runner = runner_cls(
            loaded.model, eos_token_ids=loaded.eos_token_ids, alone=engine_config.batch_invariant, **pool
        )
    codec, grammars = prompt_codec(loaded, max_input_len)
    return AsyncEngine(runner, codec, engine_config, grammars)


@contextlib.asynccontextmanager
async def started(engine: AsyncEngine):
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def collect(engine: AsyncEngine, request: GenerationRequest, delay: float = 0.0) -> list[StepEvent]:
    if delay:
        await asyncio.sleep(delay)
    return [event async for event in engine.generate(request)]


def ids_of(events: list[StepEvent], index: int = 0) -> list[int]:
    return [e.token.id for e in events if e.token is not None and e.index == index]


def final(events: list[StepEvent], index: int = 0):
    finals = [e.finish for e in events if e.finish is not None and e.index == index]
    assert len(finals) == 1 and events[-1].finish is not None
    return finals[0]


def greedy(max_new_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **kw)


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


class SlowRunner(PagedFastRunner):
    """Every step takes at least `delay` seconds, so a request can hold its place in the batch for a while."""

    delay = 0.02

    def launch_batch(self, batch):
        time.sleep(self.delay)
        return super().launch_batch(batch)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy continuation by `model.generate` (cut after the first EOS), memoised per prompt ids."""
    generate = greedy_reference(tiny_model)
    return lambda prompt_ids, max_new_tokens=NEW_TOKENS: generate(prompt_ids, max_new_tokens)


def encode(loaded, prompt: str) -> list[int]:
    return list(loaded.tokenizer(prompt)["input_ids"])


# --- greedy equals model.generate ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"batch_invariant": True},
        {"batch_invariant": True, "max_running": 3, "block_size": 4},
        {"fast_path": False, "max_running": 3, "max_prefill_tokens": 5},
        {"max_running": 3, "max_prefill_tokens": 5},  # queueing, chunked prefill
        {"max_running": 3, "max_prefill_tokens": 5, "block_size": 4},
        # a pool of 12 blocks of 4 tokens for prompts of ~10 and 12 new tokens: preemption
        {"kv_cache_memory_bytes": 12 * 4 * 2 * 2 * 16 * 2 * 4, "block_size": 4},
        # a step budget (max_num_batched_tokens) a few tokens above the decode rows
        {"max_running": 3, "max_step_tokens": 5, "block_size": 4},
        {"max_running": 3, "max_step_tokens": 4},
    ],
    ids=[
        "batched",
        "batch_invariant",
        "batch_invariant_queueing",
        "generic_chunked",
        "small_batch_chunked",
        "chunked_small_blocks",
        "preempting",
        "step_budget",
        "step_budget_tight",
    ],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["", "overlapped"])
async def test_concurrent_greedy_equals_generate(tiny_model, reference, config, async_scheduling):
    engine = make_engine(tiny_model, async_scheduling=async_scheduling, **config)
    # different lengths so sequences leave the batch at different steps
    lengths = [NEW_TOKENS - 3 * (i % 3) for i in range(len(PROMPTS))]
    async with started(engine):
        results = await asyncio.gather(
            *(
                collect(engine, GenerationRequest(p, greedy(n)), delay=0.004 * i)
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))
            )
        )
        assert engine.num_running == 0 and engine.num_waiting == 0
    if "kv_cache_memory_bytes" in config:  # the pool holds less than the batch needs: some were preempted
        assert engine.scheduler.num_preemptions > 0
    # overlapped: most steps were planned while the one before them ran
    assert engine.steps_ahead > engine.steps // 2 if async_scheduling else engine.steps_ahead == 0
    snap = engine.snapshot()  # what /metrics reads (lmiserve_engine_steps[_planned_ahead]_total)
    assert (snap.model_steps, snap.steps_planned_ahead) == (engine.steps, engine.steps_ahead)
    for prompt, n, events in zip(PROMPTS, lengths, results):
        expected = reference(encode(tiny_model, prompt), n)
        assert ids_of(events) == expected, prompt
        fin = final(events)
        assert fin.generated_tokens == len(expected)
        assert fin.reason is (
            FinishReason.EOS_TOKEN if expected[-1] in tiny_model.eos_token_ids else FinishReason.LENGTH
        )
        assert fin.generated_text == "".join(e.token.text for e in events if e.token)
        assert fin.generated_text == tiny_model.tokenizer.decode(expected, skip_special_tokens=True)
        assert fin.prompt == prompt and fin.prompt_tokens == len(encode(tiny_model, prompt))


async def test_build_engine_from_settings_and_dynamic_batching(tiny_model, reference):
    settings = Settings(batch_size=3, max_batch_delay=20)
    engine = build_engine(tiny_model, settings)
    assert engine.config.static_batching and engine.config.max_running == 3
    async with started(engine):
        results = await asyncio.gather(*(collect(engine, GenerationRequest(p, greedy())) for p in PROMPTS[:4]))
    for prompt, events in zip(PROMPTS, results):
        assert ids_of(events) == reference(encode(tiny_model, prompt))


# --- seeded sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_invariant", [False, True])
async def test_seeded_sampling_is_independent_of_the_batch(tiny_model, batch_invariant: bool):
    params = dict(do_sample=True, seed=1234, temperature=0.9, top_k=50, max_new_tokens=NEW_TOKENS)
    engine = make_engine(tiny_model, batch_invariant=batch_invariant)
    async with started(engine):
        alone = await collect(engine, GenerationRequest(PROMPTS[0], SamplingParams(**params)))
        crowd = await asyncio.gather(
            collect(engine, GenerationRequest(PROMPTS[1], greedy(30))),
            collect(engine, GenerationRequest(PROMPTS[2], SamplingParams(do_sample=True, seed=7, max_new_tokens=30))),
            collect(engine, GenerationRequest(PROMPTS[0], SamplingParams(**params)), delay=0.003),
            collect(
                engine, GenerationRequest(PROMPTS[3], SamplingParams(do_sample=True, max_new_tokens=30)), delay=0.001
            ),
        )
        other_seed = await collect(engine, GenerationRequest(PROMPTS[0], SamplingParams(**{**params, "seed": 99})))
    assert ids_of(crowd[2]) == ids_of(alone)
    assert final(alone).seed == 1234
    assert ids_of(other_seed) != ids_of(alone)


# --- admission limits ---------------------------------------------------------------------------------


async def test_full_queue_raises_engine_overloaded_at_submit(tiny_model):
    engine = make_engine(tiny_model, job_queue_size=3)  # never started: nothing leaves the queue
    engine.submit(GenerationRequest("a"))
    engine.submit(GenerationRequest("b", SamplingParams(do_sample=True, n=2)))
    with pytest.raises(Overloaded):
        engine.submit(GenerationRequest("c"))
    with pytest.raises(Overloaded):
        await anext(engine.generate(GenerationRequest("d")))
    assert engine.num_waiting == 3


async def test_queue_timeout_while_the_only_slot_is_busy(tiny_model):
    engine = make_engine(tiny_model, runner_cls=SlowRunner, max_running=1, predict_timeout=0.15)
    async with started(engine):
        # as many tokens as the context allows: >= 0.02 s per step, so the slot is busy for seconds
        most = tiny_model.max_context - len(encode(tiny_model, PROMPTS[0]))
        long = engine.generate(GenerationRequest(PROMPTS[0], greedy(most, ignore_eos_token=True)))
        first = await anext(long)  # the long request holds the slot
        assert first.token is not None
        started_at = time.monotonic()
        with pytest.raises(QueueTimeout) as info:
            await collect(engine, GenerationRequest(PROMPTS[1], greedy(5)))
        waited = time.monotonic() - started_at
        assert "Time out in: 0.15" in str(info.value)
        assert waited >= 0.15  # it waited for the slot...
        assert engine.num_waiting == 0
        # ...and timed out while the long request still held it (not because the slot came free)
        assert engine.num_running == 1
        assert (await anext(long)).token is not None
        await long.aclose()
        # the engine still serves
        events = await collect(engine, GenerationRequest(PROMPTS[2], greedy(3)))
        assert final(events).reason is FinishReason.LENGTH


# --- cancellation -----------------------------------------------------------------------------------------


async def test_closing_the_stream_frees_the_slot_within_two_steps(tiny_model):
    engine = make_engine(tiny_model, runner_cls=SlowRunner)
    async with started(engine):
        other = asyncio.ensure_future(collect(engine, GenerationRequest(PROMPTS[1], greedy(15, ignore_eos_token=True))))
        stream = engine.generate(GenerationRequest(PROMPTS[0], greedy(200, ignore_eos_token=True)))
        for _ in range(3):
            await anext(stream)
        await wait_until(lambda: engine.num_running == 2)
        steps = engine.steps
        await stream.aclose()
        await wait_until(lambda: engine.num_running == 1)
        assert engine.steps - steps <= 2
        events = await other
        assert final(events).generated_tokens == 15  # the other request is unaffected


async def test_cancelling_the_consumer_task_aborts_the_request(tiny_model):
    engine = make_engine(tiny_model, runner_cls=SlowRunner)
    async with started(engine):
        got = []

        async def consume():
            async for event in engine.generate(GenerationRequest(PROMPTS[0], greedy(200, ignore_eos_token=True))):
                got.append(event)

        task = asyncio.ensure_future(consume())
        await wait_until(lambda: len(got) >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0)
        assert len(got) < 200


async def test_cancelling_a_waiting_request_removes_it_from_the_queue(tiny_model):
    engine = make_engine(tiny_model, runner_cls=SlowRunner, max_running=1)
    async with started(engine):
        busy = engine.generate(GenerationRequest(PROMPTS[0], greedy(100, ignore_eos_token=True)))
        await anext(busy)
        waiting = asyncio.ensure_future(collect(engine, GenerationRequest(PROMPTS[1], greedy(5))))
        await wait_until(lambda: engine.num_waiting == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await wait_until(lambda: engine.num_waiting == 0)
        assert engine.num_running == 1
        await busy.aclose()
        await wait_until(lambda: engine.num_running == 0)


# --- one request's failure ----------------------------------------------------------------------------


def failing_sample(base: type[PersistentBatchRunner], bad_prompt: list[int]) -> type[PersistentBatchRunner]:
    """`base` whose sampling raises for the request of `bad_prompt` once it has generated 3 tokens (in a
    batched decode step)."""

    class FailingSampleRunner(base):  # type: ignore[valid-type,misc]
        def _row_of(self, request, device, masked):
            if request.prompt_ids == bad_prompt and len(request.output_ids) == 3:
                raise RuntimeError("sampler exploded")
            return super()._row_of(request, device, masked)

    return FailingSampleRunner


async def _one_failure(engine: AsyncEngine, tiny_model, reference, message: str, **params):
    async with started(engine):
        requests = [
            GenerationRequest(PROMPTS[0], greedy(**params), request_id="good-1"),
            GenerationRequest(PROMPTS[1], greedy(**params), request_id="bad"),
            GenerationRequest(PROMPTS[2], greedy(**params), request_id="good-2"),
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        bad = results[1]
        fin = final(bad)
        assert fin.reason is FinishReason.ERROR
        assert message in fin.error
        assert bad[-1].token is None
        for request, events in zip((requests[0], requests[2]), (results[0], results[2])):
            assert final(events).reason is not FinishReason.ERROR, final(events).error
            assert ids_of(events) == reference(encode(tiny_model, request.prompt))
        # the engine keeps serving
        after = await collect(engine, GenerationRequest(PROMPTS[3], greedy(4)))
        assert ids_of(after) == reference(encode(tiny_model, PROMPTS[3]), 4)
        assert engine.num_running == 0


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["generic", "batch_invariant"])
async def test_sampling_exception_ends_only_that_sequence(tiny_model, reference, batch_invariant):
    # A batched decode step samples every row: an exception preparing one row must not mark
    # the other decoding sequences of the batch as failed (each row is guarded on its own).
    # (rows with a top-N: plain greedy rows make no sampler row, see the test after the next)
    runner_cls = failing_sample(PagedGenericRunner, encode(tiny_model, PROMPTS[1]))
    engine = make_engine(tiny_model, runner_cls=runner_cls, batch_invariant=batch_invariant)
    await _one_failure(engine, tiny_model, reference, "sampler exploded", top_n_tokens=1)


async def test_sample_rows_exception_ends_only_that_sequence(tiny_model, reference, monkeypatch):
    import lmiserve.engine.runner.eager_sampling as paged_module

    real = paged_module.sample_rows
    bad_ids = encode(tiny_model, PROMPTS[1])

    def sample_rows(logits, rows):  # the batched sampler reports one row's failure in its place
        results = real(logits, rows)
        bad = [row.prompt_ids == bad_ids and len(row.output_ids) == 3 for row in rows]
        return [ValueError("bad row") if b else result for b, result in zip(bad, results)]

    monkeypatch.setattr(paged_module, "sample_rows", sample_rows)
    # the host's sampler (on CUDA the decode graphs pick an all-greedy step's tokens on the device)
    monkeypatch.setattr(PagedFastRunner, "_send_pick", lambda self, logits, sampled=False, top_n=0: None)
    engine = make_engine(tiny_model)
    await _one_failure(engine, tiny_model, reference, "bad row", top_n_tokens=1)


@pytest.mark.parametrize("runner_cls", [PagedFastRunner, PagedGenericRunner], ids=["fast", "generic"])
async def test_plain_greedy_rows_are_picked_without_sampler_rows(tiny_model, reference, monkeypatch, runner_cls):
    # a step whose rows all sample plain greedily takes each row's argmax at once (`_pick_greedy`): no
    # `Row` a row is made, no `sample_rows`; the tokens are those of `generate()`
    def refused(*args, **kwargs):
        raise AssertionError("a plain greedy row went through the sampler")

    monkeypatch.setattr(PersistentBatchRunner, "_row_of", refused)
    monkeypatch.setattr("lmiserve.engine.runner.eager_sampling.sample_rows", refused)
    engine = make_engine(tiny_model, runner_cls=runner_cls)
    async with started(engine):
        requests = [GenerationRequest(prompt, greedy()) for prompt in PROMPTS[:3]]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for request, events in zip(requests, results):
        assert final(events).reason is not FinishReason.ERROR, final(events).error
        assert ids_of(events) == reference(encode(tiny_model, request.prompt))


async def test_plain_greedy_pick_failure_ends_the_step_rows_only(tiny_model, reference, monkeypatch):
    # the at-once pick of plain greedy rows fails once: that step's rows end with the error, the engine goes on
    import lmiserve.engine.runner.persistent_batch as paged_module

    real, calls = paged_module.greedy_pick, []

    def greedy_pick(logits):
        calls.append(len(logits))
        if len(calls) == 3:
            raise RuntimeError("pick exploded")
        return real(logits)

    monkeypatch.setattr(paged_module, "greedy_pick", greedy_pick)
    monkeypatch.setattr(PagedFastRunner, "_send_pick", lambda self, logits, sampled=False, top_n=0: None)
    engine = make_engine(tiny_model)
    async with started(engine):
        failed = await collect(engine, GenerationRequest(PROMPTS[0], greedy()))
        assert final(failed).reason is FinishReason.ERROR
        assert "exception occurred during sampling: pick exploded" in final(failed).error
        after = await collect(engine, GenerationRequest(PROMPTS[3], greedy(4)))
        assert ids_of(after) == reference(encode(tiny_model, PROMPTS[3]), 4)
        assert engine.num_running == 0


class FailingPagedRunner(PagedFastRunner):
    """Over the block cache: every forward that computes request "bad"'s prompt raises, and sampling
    its fourth token raises (the persistent batch's own bookkeeping)."""

    bad_prompt: tuple[int, ...] = ()
    fail_prefill = True

    def _forward_rows(self, batch, part):
        for i in part:
            row = batch.rows[i]
            bad = list(self.bad_prompt[row.start : row.start + len(row.token_ids)])
            if self.fail_prefill and i >= batch.num_decode and row.token_ids == bad:
                raise RuntimeError("prefill exploded")
        return super()._forward_rows(batch, part)

    def _row_of(self, request, device, masked):
        if not self.fail_prefill and request.prompt_ids == list(self.bad_prompt) and len(request.output_ids) == 3:
            raise RuntimeError("sampler exploded")
        return super()._row_of(request, device, masked)


@pytest.mark.parametrize("fail_prefill", [True, False], ids=["prefill", "sampling"])
async def test_a_failure_in_a_paged_batch_ends_only_that_sequence(tiny_model, reference, fail_prefill):
    runner_cls = type("Failing", (FailingPagedRunner,), {"bad_prompt": tuple(encode(tiny_model, PROMPTS[1]))})
    runner_cls.fail_prefill = fail_prefill
    engine = make_engine(tiny_model, runner_cls=runner_cls)
    if fail_prefill:
        await _one_failure(engine, tiny_model, reference, "prefill exploded")
    else:  # rows with a top-N past what a decode graph samples: the eager sampler's rows on any device (plain
        # greedy rows make no sampler row; on CUDA a graph samples a small top-N itself)
        await _one_failure(engine, tiny_model, reference, "sampler exploded", top_n_tokens=GRAPH_TOP_N + 1)


# --- prompt length -----------------------------------------------------------------------------------------


async def test_prompt_longer_than_max_input_len_is_rejected(tiny_model):
    engine = make_engine(tiny_model, max_input_len=8)
    prompt = "The quick brown fox jumps over the lazy dog. Hello world!"
    n = len(encode(tiny_model, prompt))
    assert n > 8
    with pytest.raises(InvalidRequest) as info:
        engine.submit(GenerationRequest(prompt))
    assert f"({n} tokens)" in str(info.value) and "limit of 8" in str(info.value)
    with pytest.raises(InvalidRequest):
        await anext(engine.generate(GenerationRequest(prompt)))
    assert engine.num_waiting == 0


async def test_prompt_plus_max_new_tokens_beyond_the_context_is_rejected(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequest) as info:
        engine.submit(GenerationRequest("Hello", greedy(tiny_model.max_context)))
    assert str(tiny_model.max_context) in str(info.value)


async def test_truncate_keeps_the_last_tokens(tiny_model, reference):
    engine = make_engine(tiny_model, max_input_len=8)
    prompt = "The quick brown fox jumps over the lazy dog. Hello world!"
    ids = encode(tiny_model, prompt)
    async with started(engine):
        events = await collect(engine, GenerationRequest(prompt, greedy(8, truncate=6)))
    fin = final(events)
    assert fin.prompt_tokens == 6
    assert ids_of(events) == reference(ids[-6:], 8)


# --- n / best_of ---------------------------------------------------------------------------------------


async def test_best_of_without_n_returns_only_the_best_sequence(tiny_model):
    """SamplingParams.best_of sequences are generated, SamplingParams.n (default 1) returned, best first."""
    engine = make_engine(tiny_model)
    request = GenerationRequest(PROMPTS[0], SamplingParams(do_sample=True, seed=5, max_new_tokens=8, best_of=3))
    async with started(engine):
        events = await collect(engine, request)
    assert {e.index for e in events} == {0}
    assert final(events, 0).generated_tokens == 8


@pytest.mark.parametrize("params", [{"n": 3}, {"n": 3, "best_of": 3}])
async def test_n_sequences_come_best_first(tiny_model, params):
    engine = make_engine(tiny_model)
    request = GenerationRequest(PROMPTS[0], SamplingParams(do_sample=True, seed=5, max_new_tokens=8, **params))
    async with started(engine):
        events = await collect(engine, request)
    indexes = [e.index for e in events]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1, 2}  # whole sequences, in order
    scores = []
    for index in range(3):
        fin = final(events, index)
        tokens = [e.token for e in events if e.index == index and e.token is not None]
        assert fin.generated_tokens == len(tokens)
        assert fin.generated_text == "".join(t.text for t in tokens)
        scores.append(sum(t.logprob for t in tokens) / len(tokens))  # per token: OpenAI's and TGI's rule
    assert scores[0] == max(scores)
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(ids_of(events, i)) for i in range(3)}) > 1  # different seeds, different samples


async def test_unranked_n_sequences_stream_interleaved_as_they_are_generated(tiny_model):
    """OpenAI's `n` (a request that is not `ranked`): every sequence's events as the steps make them."""
    engine = make_engine(tiny_model)
    params = SamplingParams(do_sample=True, seed=5, max_new_tokens=8, n=2, best_of=2, ignore_eos_token=True)
    async with started(engine):
        events = await collect(engine, GenerationRequest(PROMPTS[0], params, ranked=False))
        ranked = await collect(engine, GenerationRequest(PROMPTS[0], params))
    order = [e.index for e in events]
    assert sorted(order) == [0] * 8 + [1] * 8
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 starts before choice 0 ends
    assert {tuple(ids_of(events, i)) for i in (0, 1)} == {tuple(ids_of(ranked, i)) for i in (0, 1)}  # same samples


# --- runner features through the engine ------------------------------------------------------------


@pytest.mark.parametrize("max_prefill_tokens", [2048, 3])
async def test_prompt_logprobs_match_a_full_forward_pass(tiny_model, max_prefill_tokens: int):
    prompt = PROMPTS[3]
    ids = encode(tiny_model, prompt)
    with torch.inference_mode():
        logits = tiny_model.model(torch.tensor([ids], device=tiny_model.device)).logits[0].float().cpu()
    expected = logits.log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    engine = make_engine(tiny_model, max_prefill_tokens=max_prefill_tokens)
    async with started(engine):
        events = await collect(engine, GenerationRequest(prompt, greedy(3, decoder_input_details=True)))
    prefill = final(events).prefill
    assert [t.id for t in prefill] == ids
    assert prefill[0].logprob is None
    assert [t.logprob for t in prefill[1:]] == pytest.approx(expected, abs=1e-4)


async def test_min_new_tokens_bans_stop_token_ids(tiny_model, reference):
    prompt = PROMPTS[0]
    expected = reference(encode(tiny_model, prompt))
    stop_id = expected[1]
    assert stop_id not in expected[:1]
    engine = make_engine(tiny_model)
    async with started(engine):
        plain = await collect(engine, GenerationRequest(prompt, greedy(stop_token_ids=[stop_id])))
        held = await collect(engine, GenerationRequest(prompt, greedy(10, stop_token_ids=[stop_id], min_new_tokens=4)))
    assert ids_of(plain) == expected[:2] and final(plain).reason is FinishReason.STOP_SEQUENCE
    assert ids_of(held)[0] == expected[0]
    assert stop_id not in ids_of(held)[:4]


async def test_unseeded_requests_report_the_seed_they_used(tiny_model):
    engine = make_engine(tiny_model)
    params = dict(do_sample=True, max_new_tokens=12)
    async with started(engine):
        first = await collect(engine, GenerationRequest(PROMPTS[0], SamplingParams(**params)))
        seed = final(first).seed
        assert isinstance(seed, int) and 0 <= seed < 2**31
        again = await collect(engine, GenerationRequest(PROMPTS[0], SamplingParams(seed=seed, **params)))
    assert ids_of(again) == ids_of(first)


# --- a failing model step ----------------------------------------------------------------------------


class FailingStepRunner(PagedFastRunner):
    """`launch_batch` itself raises (outside the per-request guards) whenever the request of prompt
    `poison` is in the batch."""

    poison: tuple[int, ...] = ()

    def launch_batch(self, batch):
        if any(list(new.prompt_ids) == list(self.poison) for new in batch.new) or any(
            row.seq_id in self._requests and self._requests[row.seq_id].prompt_ids == list(self.poison)
            for row in batch.rows
        ):
            raise RuntimeError("device lost")
        return super().launch_batch(batch)


async def test_a_step_that_raises_ends_its_requests_instead_of_retrying_forever(tiny_model, reference):
    # AsyncEngine._loop catches the exception and runs _step again: the scheduler was never told, so
    # it plans the very same step, which fails again, forever; the request never gets a final event.
    runner_cls = type("Poisoned", (FailingStepRunner,), {"poison": tuple(encode(tiny_model, PROMPTS[0]))})
    engine = make_engine(tiny_model, runner_cls=runner_cls)
    async with started(engine):
        try:
            events = await asyncio.wait_for(
                collect(engine, GenerationRequest(PROMPTS[0], greedy(5), request_id="poison")), timeout=HANG_TIMEOUT
            )
        except asyncio.TimeoutError:
            pytest.fail("the request never ended: the engine retries the failing step forever")
        assert final(events).reason is FinishReason.ERROR
        assert "device lost" in (final(events).error or "")
        after = await asyncio.wait_for(collect(engine, GenerationRequest(PROMPTS[1], greedy(4))), timeout=HANG_TIMEOUT)
        assert ids_of(after) == reference(encode(tiny_model, PROMPTS[1]), 4)


async def test_an_engine_core_that_raises_ends_every_request_and_serves_no_more(tiny_model):
    """Planning raising outside the per-request guards (a scheduler bug): the loop used to log and plan
    again forever, the requests hanging. Now every open request ends with an error (a running stream
    in-band, a waiting one too), the engine refuses new requests, and its failure listeners are told."""
    from lmiserve.core.errors import GenerationFailed, ModelNotReady

    engine = make_engine(tiny_model, max_running=1)
    told: list[str] = []
    engine.on_failure.append(told.append)
    async with started(engine):
        running = asyncio.create_task(collect(engine, GenerationRequest(PROMPTS[0], greedy(200))))
        await wait_until(lambda: engine.num_running == 1)
        waiting = asyncio.create_task(collect(engine, GenerationRequest(PROMPTS[1], greedy(4))))
        await wait_until(lambda: engine.num_waiting == 1)

        def broken(now, **_):
            raise RuntimeError("planner bug")

        engine.scheduler.schedule = broken
        for task in (running, waiting):
            with pytest.raises(GenerationFailed, match="the engine failed: RuntimeError: planner bug"):
                await asyncio.wait_for(task, timeout=HANG_TIMEOUT)
        assert told == ["the engine failed: RuntimeError: planner bug"]
        with pytest.raises(ModelNotReady, match="planner bug"):
            await collect(engine, GenerationRequest(PROMPTS[2], greedy(2)))


def test_a_failed_engine_makes_its_model_failed_and_tells_the_server(tiny_model):
    """The service of a failed engine is FAILED (/ping and the ready probes answer 503), and the
    listener `lmiserve serve` gives it (Lifecycle.on_engine_failed: exit 4) is called."""
    from lmiserve.models.service import ModelService
    from lmiserve.server.lifecycle import ExitCode, Lifecycle

    service = ModelService(Settings(), name="tiny")
    engine = make_engine(tiny_model)
    service.attach_llm(tiny_model, engine)
    service.status = ModelService.READY
    lifecycle = Lifecycle()
    service.on_engine_failed.append(lifecycle.on_engine_failed)
    engine._die(RuntimeError("planner bug"))
    assert (service.status, service.error) == (ModelService.FAILED, "the engine failed: RuntimeError: planner bug")
    assert lifecycle.exit_code is ExitCode.ENGINE_FAILED
    assert lifecycle.failure == "engine failed: tiny: the engine failed: RuntimeError: planner bug"
