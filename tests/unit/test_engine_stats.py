"""What AsyncEngine tells its observers (lmiserve.core.stats), on the tiny random Llama: each request
reported once with its sequences' timestamps in order, every step's tokens adding up to exactly the
tokens the requests produced, refusals and failures reported as such, and the live snapshot."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.waiting import async_wait_until
from lmiserve.core import request_context
from lmiserve.core.errors import InvalidRequest, Overloaded, QueueTimeout
from lmiserve.core.events import FinishReason, StepEvent
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.request_context import RequestFacts
from lmiserve.core.stats import RequestStats, StepStats
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine


class Recorder:
    def __init__(self) -> None:
        self.rejected: list[BaseException] = []
        self.submitted: list[tuple[int, int]] = []
        self.steps: list[StepStats] = []
        self.finished: list[RequestStats] = []

    def on_rejected(self, error: BaseException) -> None:
        self.rejected.append(error)

    def on_submitted(self, prompt_tokens: int, sequences: int) -> None:
        self.submitted.append((prompt_tokens, sequences))

    def on_step(self, step: StepStats) -> None:
        self.steps.append(step)

    def on_finished(self, request: RequestStats) -> None:
        self.finished.append(request)


class Broken:
    """An observer that fails at every call: requests and the loop must not notice."""

    def __getattr__(self, name: str):
        def fail(*args: object) -> None:
            raise RuntimeError(f"{name} is broken")

        return fail


def engine_with(tiny_model, **config) -> tuple[AsyncEngine, Recorder]:
    engine = create_engine(tiny_model, EngineConfig(**config))
    recorder = Recorder()
    engine.add_observer(Broken())
    engine.add_observer(recorder)
    return engine, recorder


async def run(engine: AsyncEngine, prompt: str, **params) -> list[StepEvent]:
    return [e async for e in engine.generate(GenerationRequest(prompt, SamplingParams(**params)))]


def prompt_len(tiny_model, prompt: str) -> int:
    return len(tiny_model.tokenizer(prompt)["input_ids"])


async def test_each_request_is_reported_once_with_its_tokens_and_times(tiny_model):
    engine, seen = engine_with(tiny_model)
    engine.start()
    try:
        prompts = ["The quick brown fox", "Hello world! How are you", "naïve café"]
        results = await asyncio.gather(
            *(run(engine, p, max_new_tokens=4 + i, ignore_eos_token=True) for i, p in enumerate(prompts))
        )
    finally:
        await engine.stop()
    lengths = [prompt_len(tiny_model, p) for p in prompts]
    assert sorted(seen.submitted) == sorted((n, 1) for n in lengths)
    assert len(seen.finished) == 3 and seen.rejected == []
    generated = [len([e for e in events if e.token is not None]) for events in results]
    assert generated == [4, 5, 6]
    assert sorted(r.sequences[0].generated_tokens for r in seen.finished) == generated
    for request in seen.finished:
        (seq,) = request.sequences
        assert request.succeeded and seq.reason is FinishReason.LENGTH
        assert seq.scheduled is not None and seq.first_token is not None
        assert request.arrival == seq.arrival <= seq.scheduled <= seq.first_token <= seq.finished <= request.finished
        assert seq.max_new_tokens == seq.generated_tokens
    # every prompt token prefilled once, every token counted once, in the steps that made them
    assert sum(s.prompt_tokens for s in seen.steps) == sum(lengths)
    assert sum(s.generated_tokens for s in seen.steps) == sum(generated)
    assert engine.snapshot().generated_tokens == sum(generated)
    assert sum(len(s.first_token_latencies) for s in seen.steps) == 3
    assert sum(len(s.inter_token_latencies) for s in seen.steps) == sum(generated) - 3
    assert all(s.duration >= 0 and s.rows >= 1 for s in seen.steps)
    assert {s.method for s in seen.steps} == {"prefill", "decode"}
    assert all(s.prompt_tokens > 0 for s in seen.steps if s.method == "prefill")
    assert all(s.prompt_tokens == 0 for s in seen.steps if s.method == "decode")


async def test_n_sequences_are_one_request(tiny_model):
    engine, seen = engine_with(tiny_model)
    engine.start()
    try:
        await run(engine, "Hello", max_new_tokens=3, ignore_eos_token=True, do_sample=True, n=2, seed=1)
    finally:
        await engine.stop()
    assert seen.submitted == [(prompt_len(tiny_model, "Hello"), 2)]
    (request,) = seen.finished
    assert [s.generated_tokens for s in request.sequences] == [3, 3]
    assert sum(s.generated_tokens for s in seen.steps) == 6


async def test_refusals_are_reported_and_never_finish(tiny_model):
    engine, seen = engine_with(tiny_model, job_queue_size=1)  # never started: nothing leaves the queue
    with pytest.raises(InvalidRequest):
        engine.submit(GenerationRequest("hi", SamplingParams(max_new_tokens=tiny_model.max_context)))
    engine.submit(GenerationRequest("a"))
    with pytest.raises(Overloaded):
        engine.submit(GenerationRequest("b"))
    assert [type(e) for e in seen.rejected] == [InvalidRequest, Overloaded]
    assert len(seen.submitted) == 1 and seen.finished == []


async def test_a_client_that_leaves_is_an_abort_and_a_queue_timeout_an_error(tiny_model):
    engine, seen = engine_with(tiny_model, max_running=1, predict_timeout=0.2)
    launch = engine.runner.launch_batch  # type: ignore[attr-defined]

    def slower(batch):  # noqa: ANN001, ANN202 - a step of 5 ms at least: the long request outlasts the timeout
        time.sleep(0.005)  # (the tiny model's 254 tokens took 0.15 s on an AMD EPYC: less than the timeout)
        return launch(batch)

    engine.runner.launch_batch = slower  # type: ignore[attr-defined]
    engine.start()
    try:
        most = tiny_model.max_context - prompt_len(tiny_model, "Hello")
        long = engine.generate(GenerationRequest("Hello", SamplingParams(max_new_tokens=most, ignore_eos_token=True)))
        await anext(long)  # holds the only slot
        snap = engine.snapshot()
        assert (snap.running, snap.waiting) == (1, 0)
        assert snap.batch_max_tokens == tiny_model.max_context
        assert 0 < snap.kv_tokens <= tiny_model.max_context
        assert snap.kv_capacity == tiny_model.max_context  # one slot
        waiting = asyncio.ensure_future(run(engine, "Hi", max_new_tokens=2))
        await async_wait_until(lambda: engine.snapshot().waiting == 1, "the second request waits")
        with pytest.raises(QueueTimeout):
            await waiting
        await long.aclose()
        await async_wait_until(lambda: len(seen.finished) == 2, "both requests are reported")
        after = engine.snapshot()
        assert (after.running, after.waiting, after.batch_max_tokens, after.kv_tokens) == (0, 0, 0, 0)
        assert (after.kv_capacity, after.batch_slots) == (tiny_model.max_context, 1)
        assert after.generated_tokens >= snap.generated_tokens >= 1
    finally:
        await engine.stop()
    timed_out, aborted = seen.finished
    assert isinstance(timed_out.error, QueueTimeout) and not timed_out.succeeded
    assert timed_out.sequences[0].scheduled is None and timed_out.sequences[0].reason is FinishReason.ERROR
    assert aborted.error is None and not aborted.succeeded
    assert aborted.sequences[0].reason is FinishReason.ABORT and aborted.sequences[0].generated_tokens >= 1


async def test_each_generation_is_recorded_in_the_facts_of_the_request_it_ran_for(tiny_model):
    """What the traces' spans are made of (lmiserve.server.tracing): the settings and times of every
    generation, recorded in the facts of the request being served, also for a client that left."""
    engine, _ = engine_with(tiny_model)
    facts = RequestFacts("r-1")
    engine.start()
    try:
        token = request_context.bind(facts)
        try:
            await run(engine, "The quick brown fox", max_new_tokens=3, ignore_eos_token=True)
            params = SamplingParams(
                max_new_tokens=50, ignore_eos_token=True, do_sample=True, temperature=0.5, top_p=0.8
            )
            events = engine.generate(GenerationRequest("Hello world", params))
            await events.__anext__()  # the first token, then the client goes away
            await events.aclose()
        finally:
            request_context.unbind(token)
        await run(engine, "outside any request", max_new_tokens=2)  # recorded nowhere
    finally:
        await engine.stop()
    done, left = facts.generations
    assert (done.max_new_tokens, done.temperature, done.top_p) == (3, 0.0, 1.0)  # greedy: temperature 0
    (seq,) = done.stats.sequences
    assert seq.scheduled is not None and seq.first_token is not None
    assert seq.arrival <= seq.scheduled <= seq.first_token <= seq.finished
    assert (seq.generated_tokens, seq.reason) == (3, FinishReason.LENGTH)
    assert (left.max_new_tokens, left.temperature, left.top_p) == (50, 0.5, 0.8)
    (seq,) = left.stats.sequences
    assert seq.first_token is not None and seq.reason is FinishReason.ABORT and seq.generated_tokens >= 1
