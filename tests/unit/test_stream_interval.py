"""`stream_interval`: a sequence's tokens are delivered N at a time (its first at once), the same tokens as
one at a time; the events the engine delivers at once say `burst` (a speculative step's tokens too), and a
streamed response writes a burst as one chunk (server/pipeline.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from helpers.engines import running_engine
from lmiserve.core.errors import GenerationFailed
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.handles import RequestHandle
from lmiserve.engine.speculative.proposers import SpeculationSettings
from lmiserve.server.pipeline import _in_band_chunks

PROMPTS = ["The quick brown fox", "Hello world! How are you", "Numbers like 1, 2, 3"]


def token(n: int) -> StepEvent:
    return StepEvent(token=Token(n, f"t{n}", None))


def finished(n: int) -> StepEvent:
    return StepEvent(token=Token(n, f"t{n}", None), finish=Finish(FinishReason.LENGTH, "", n, "", 1))


def queued(handle: RequestHandle) -> list[StepEvent | BaseException]:
    out = []
    while not handle.queue.empty():
        out.append(handle.queue.get_nowait())
    return out


def test_a_handle_sends_the_first_token_at_once_then_n_at_a_time():
    handle = RequestHandle(GenerationRequest("x"), [], 0.0)
    for n in range(1, 7):
        handle.offer(7, token(n), 3)
    # t1 at once; t2, t3, t4 together; t5 and t6 held; the end brings them with it
    assert [(e.token.id, e.burst) for e in queued(handle)] == [(1, False), (2, True), (3, True), (4, False)]
    handle.deliver(7, finished(7))
    assert [(e.token.id, e.burst) for e in queued(handle)] == [(5, True), (6, True), (7, False)]
    # a request that fails delivers what it held before its error
    handle.offer(9, token(1), 4)
    handle.offer(9, token(2), 4)
    error = GenerationFailed("the engine failed")
    handle.fail(error)
    assert [(e.token.id, e.burst) if isinstance(e, StepEvent) else e for e in queued(handle)] == [
        (1, False),
        (2, True),
        error,
    ]
    # one at a time: a token says `burst` only when the caller delivers the next one with it
    handle.offer(11, token(1), 1, more=True)
    handle.offer(11, token(2), 1)
    assert [(e.token.id, e.burst) for e in queued(handle)] == [(1, True), (2, False)]


async def test_the_engine_delivers_the_same_tokens_n_at_a_time(tiny_model):
    params = SamplingParams(max_new_tokens=10, ignore_eos_token=True)
    requests = [GenerationRequest(p, params) for p in PROMPTS]

    async def events(engine, request) -> list[StepEvent]:
        return [event async for event in engine.generate(request)]

    async with running_engine(tiny_model) as engine:
        one_at_a_time = await asyncio.gather(*(events(engine, r) for r in requests))
    async with running_engine(tiny_model, stream_interval=4) as engine:
        four_at_a_time = await asyncio.gather(*(events(engine, r) for r in requests))
    for alone, grouped in zip(one_at_a_time, four_at_a_time, strict=True):
        assert [e.token.id for e in grouped] == [e.token.id for e in alone] and len(grouped) == 10
        assert not any(e.burst for e in alone)
        # the first token alone, then groups of four; the last group (three tokens) ends with the finish
        assert [e.burst for e in grouped] == [False, True, True, True, False, True, True, True, False, False]
        assert grouped[-1].finish is not None and grouped[-1].finish.generated_tokens == 10


async def test_a_speculative_steps_tokens_are_one_burst(tiny_model):
    spec = SpeculationSettings("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
    params = SamplingParams(max_new_tokens=32, ignore_eos_token=True)
    requests = [GenerationRequest(p, params) for p in ("abc abc abc abc", "1, 2, 3, 1, 2, 3, 1, 2")]

    async def events(engine, request) -> list[StepEvent]:
        return [event async for event in engine.generate(request)]

    async with running_engine(tiny_model) as engine:
        plain = [await events(engine, r) for r in requests]
    async with running_engine(tiny_model, speculation=spec) as engine:
        drafted = [await events(engine, r) for r in requests]
        info = engine.snapshot().speculation
    assert [[e.token.id for e in one] for one in drafted] == [[e.token.id for e in one] for one in plain]
    assert info is not None and info["num_accepted_tokens"] > 0, info
    # a step that kept drafts delivered its tokens at once: every one but its last says so
    bursts = sum(e.burst for one in drafted for e in one)
    assert 0 < bursts <= info["num_accepted_tokens"] and not any(one[-1].burst for one in drafted)
    assert not any(e.burst for one in plain for e in one)


class Lines:
    """An encoder of one line a token."""

    content_type = "application/jsonlines"
    streaming = True

    def on_event(self, index: int, event: StepEvent) -> bytes:
        return f"{event.token.id}\n".encode() if event.token is not None else b""

    def close(self) -> bytes:
        return b"end\n"

    def error(self, exc: Exception) -> bytes:
        return f"error: {exc}\n".encode()


async def chunks(events: list[StepEvent | BaseException]) -> list[bytes]:
    async def tagged() -> AsyncIterator[tuple[int, StepEvent]]:
        for event in events:
            if isinstance(event, BaseException):
                raise event
            yield 0, event

    return [chunk async for chunk in _in_band_chunks(tagged(), Lines())]


def bursting(*ids: int) -> list[StepEvent]:
    return [StepEvent(token=Token(n, "", None), burst=True) for n in ids]


async def test_a_burst_is_written_as_one_chunk():
    events = [token(1), *bursting(2, 3), token(4), *bursting(5), finished(6)]
    assert await chunks(events) == [b"1\n", b"2\n3\n4\n", b"5\n6\n", b"end\n"]
    # a failure in the middle of a burst: what came before it goes out with the error
    failed = await chunks([token(1), *bursting(2, 3), GenerationFailed("boom")])
    assert failed == [b"1\n", b"2\n3\nerror: boom\n"]
