"""The serving process's side of `engine_process` (engine/process/client.py) against a scripted engine on the
other end of a real pipe: what it sends, how it hands the engine's messages to each request, and what a
failure or a lost engine process does to open and new requests."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import pytest

from lmiserve.core.errors import GenerationFailed, InvalidRequest, ModelNotReady
from lmiserve.core.events import StepEvent, Token
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.stats import EngineSnapshot
from lmiserve.engine.process.client import EngineProcessClient
from lmiserve.engine.process.wire import Ended


class FakeProcess:
    pid, exitcode = 4242, -9

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def snapshot(running: int = 0) -> EngineSnapshot:
    return EngineSnapshot(running, 0, 0, 0, 1024, 8, 0)


def event(text: str) -> StepEvent:
    return StepEvent(token=Token(id=1, text=text, logprob=None))


@pytest.fixture
def pair() -> Any:
    ours, engine = mp.get_context("spawn").Pipe()
    client = EngineProcessClient(FakeProcess(), ours, snapshot())
    yield client, engine
    engine.close()


async def read(engine: Any) -> tuple[Any, ...]:
    return await asyncio.to_thread(engine.recv)


async def test_a_request_goes_to_the_engine_and_its_events_come_back(pair):
    client, engine = pair
    client.start()
    request = GenerationRequest(prompt="Hi")
    stream = client.generate(request)
    first = asyncio.ensure_future(anext(stream))
    kind, rid, sent = await read(engine)
    assert (kind, sent.prompt) == ("generate", "Hi")
    engine.send(("batch", [(rid, event("a"))], [], snapshot(running=1), None))
    assert (await first).token.text == "a"
    assert client.num_running == 1  # the engine's snapshot, with each message
    engine.send(("batch", [(rid, event("b")), (rid, Ended(()))], [], snapshot(), None))
    assert [e.token.text async for e in stream] == ["b"]
    assert client.num_running == 0


async def test_steps_that_wait_together_go_out_as_one_burst(pair):
    client, _ = pair
    client.start()
    stream = client.generate(GenerationRequest(prompt="Hi"))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    rid = next(iter(client._queues))
    # three steps' messages read at once (the loop was behind): one write of the stream's tokens
    client._dispatch(
        [("batch", [(rid, event(t))], [], snapshot(), None) for t in "xyz"]
        + [("batch", [(rid, Ended(()))], [], snapshot(), None)]
    )
    events = [await first] + [e async for e in stream]
    assert [(e.token.text, e.burst) for e in events] == [("x", True), ("y", True), ("z", False)]


async def test_a_client_that_leaves_aborts_its_request(pair):
    client, engine = pair
    client.start()
    stream = client.generate(GenerationRequest(prompt="Hi"))
    first = asyncio.ensure_future(anext(stream))
    _, rid, _ = await read(engine)
    engine.send(("batch", [(rid, event("a"))], [], snapshot(), None))
    await first
    await stream.aclose()
    assert await read(engine) == ("abort", rid)


async def test_prepare_raises_the_engines_error(pair):
    client, engine = pair
    client.start()
    prepared = asyncio.ensure_future(client.prepare(GenerationRequest(prompt="Hi")))
    kind, call, _ = await read(engine)
    assert kind == "prepare"
    engine.send(("reply", call, InvalidRequest("too long")))
    with pytest.raises(InvalidRequest, match="too long"):
        await prepared


async def test_observers_see_what_the_engine_told_them_in_order(pair):
    client, engine = pair
    seen: list[tuple[str, tuple]] = []

    class Observer:
        def __getattr__(self, name: str) -> Any:
            return lambda *args: seen.append((name, args))

    client.add_observer(Observer())
    client.start()
    engine.send(("batch", [], [("on_submitted", (3, 1)), ("on_finished", ("stats",))], snapshot(), None))
    await asyncio.wait_for(_until(lambda: len(seen) == 2), 10)
    assert seen == [("on_submitted", (3, 1)), ("on_finished", ("stats",))]


async def test_the_engine_process_lost_fails_open_and_new_requests(pair):
    client, engine = pair
    told: list[str] = []
    client.on_failure.append(told.append)
    client.start()
    stream = client.generate(GenerationRequest(prompt="Hi"))
    first = asyncio.ensure_future(anext(stream))
    await read(engine)
    engine.close()  # the process died: its end of the pipe closed
    with pytest.raises(GenerationFailed, match=r"the engine process \(pid 4242\) was killed by signal 9"):
        await first
    assert told == ["the engine process (pid 4242) was killed by signal 9"]
    with pytest.raises(ModelNotReady):
        await anext(client.generate(GenerationRequest(prompt="Hi")))


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_consumer_that_stops_at_the_last_event_ends_the_request_there(pair):
    """A protocol stops reading at a sequence's last event: its end, in the same message, is taken from the
    queue (what the engine ran is recorded for the traces) and nothing is aborted."""
    from lmiserve.core import request_context
    from lmiserve.core.request_context import Generation
    from lmiserve.core.stats import RequestStats

    client, engine = pair
    facts = request_context.RequestFacts("r1")
    request_context.bind(facts)
    client.start()
    stream = client.generate(GenerationRequest(prompt="Hi"))
    first = asyncio.ensure_future(anext(stream))
    _, rid, _ = await read(engine)
    generation = Generation(4, 0.0, 1.0, RequestStats(1.0, 2.0, 3, ()))
    engine.send(("batch", [(rid, event("last")), (rid, Ended((generation,)))], [], snapshot(), None))
    assert (await first).token.text == "last"
    await stream.aclose()
    assert facts.generations == [generation]
    assert not await asyncio.to_thread(engine.poll, 0.2)  # no abort


@pytest.fixture
def coded() -> Any:
    """A client with the model's prompt codec and grammar compiler (a text model's, as `start_engine_process`
    gives them) and a pool of 4 blocks of 8 tokens."""
    from helpers.tiny_model import build_tiny_tokenizer
    from lmiserve.engine.text.grammar_compiler import GrammarCompiler
    from lmiserve.engine.text.tokenizer import HfTokenizer
    from lmiserve.engine.text.validation import PromptCodec

    tokenizer = build_tiny_tokenizer()
    codec = PromptCodec(HfTokenizer(tokenizer), eos_token_ids={tokenizer.eos_token_id}, max_context=64)
    grammars = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    ours, engine = mp.get_context("spawn").Pipe()
    pool = EngineSnapshot(0, 0, 0, 0, 32, 8, 0, kv_blocks=4, kv_block_size=8)
    client = EngineProcessClient(FakeProcess(), ours, pool, codec=codec, grammars=grammars)
    yield client, engine, tokenizer
    engine.close()


async def test_a_text_request_is_prepared_here_and_the_engine_process_gets_its_ids(coded):
    """No `prepare` round trip to a busy engine process, and the engine process tokenizes nothing: the
    prompt is encoded once, here (the protocol's count of it recalled), and sent with its ids."""
    client, engine, tokenizer = coded
    client.start()
    request = GenerationRequest(prompt="Hello there", params=SamplingParams(max_new_tokens=4))
    await client.prepare(request)
    stream = client.generate(request)
    first = asyncio.ensure_future(anext(stream))
    kind, rid, sent = await read(engine)
    assert kind == "generate" and sent.prompt == "Hello there"
    assert sent.prompt_ids == tokenizer("Hello there")["input_ids"]
    engine.send(("batch", [(rid, Ended(()))], [], snapshot(), None))
    with pytest.raises(StopAsyncIteration):
        await first


async def test_a_request_whose_kv_outgrows_the_pool_is_refused_here_in_the_engines_words(coded):
    client, engine, _ = coded
    rejected: list[BaseException] = []

    class Observer:
        def on_rejected(self, error: BaseException) -> None:
            rejected.append(error)

    client.add_observer(Observer())
    client.start()
    request = GenerationRequest(prompt="Hello there", params=SamplingParams(max_new_tokens=40))
    with pytest.raises(InvalidRequest, match=r"more than the whole KV cache holds \(32 tokens"):
        await client.prepare(request)
    assert len(rejected) == 1 and not engine.poll(0.1)  # counted as the engine counts it; nothing sent


async def test_a_grammar_is_compiled_here_and_an_unprepared_prompt_left_to_the_engine_process(coded):
    """A grammar is compiled here (cached; the engine process compiles it again from its own cache): nothing
    goes to a busy engine process before the stream, and a grammar the library refuses is the engine's 400,
    counted as a rejection. A client given no compiler (the constructor's default) asks the engine process.
    A prompt this request never encoded goes as text: the engine process encodes it."""
    from lmiserve.core.grammar import Grammar

    client, engine, _ = coded
    rejected: list[BaseException] = []

    class Observer:
        def on_rejected(self, error: BaseException) -> None:
            rejected.append(error)

    client.add_observer(Observer())
    client.start()
    grammar = GenerationRequest(prompt="Hi", params=SamplingParams(max_new_tokens=4, grammar=Grammar("regex", "a+")))
    await asyncio.wait_for(client.prepare(grammar), 5)  # (nothing answers a call to the engine process here)
    assert client.grammars.cached(grammar.params.grammar) is not None and not engine.poll(0.1)
    broken = GenerationRequest(prompt="Hi", params=SamplingParams(max_new_tokens=4, grammar=Grammar("regex", "(")))
    with pytest.raises(InvalidRequest, match="invalid regex"):
        await client.prepare(broken)
    assert len(rejected) == 1 and not engine.poll(0.1)
    client.grammars = None
    prepared = asyncio.ensure_future(client.prepare(grammar))
    kind, call, _ = await read(engine)
    assert kind == "prepare"
    engine.send(("reply", call, None))
    await prepared
    stream = client.generate(GenerationRequest(prompt="Never counted"))
    first = asyncio.ensure_future(anext(stream))
    kind, rid, sent = await read(engine)
    assert kind == "generate" and sent.prompt_ids is None
    engine.send(("batch", [(rid, Ended(()))], [], snapshot(), None))
    with pytest.raises(StopAsyncIteration):
        await first
