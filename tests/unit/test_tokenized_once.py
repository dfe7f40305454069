"""A prompt is tokenized once: the ids a protocol's validation counted are the engine's, for the same
text in the same request's task, and never another task's."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from helpers.engines import scratch_blocks
from lmiserve.core.errors import InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tokenizer import recall_encoding, remember_encoding, tokenizing
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.text.tokenizer import HfTokenizer


class Counting:
    """A transformers tokenizer that counts its calls."""

    def __init__(self, hf) -> None:
        self.hf, self.calls = hf, 0

    def __call__(self, text):
        self.calls += 1
        return self.hf(text)


async def test_the_engine_reuses_the_ids_validation_counted_for_the_same_text(tiny_model):
    counting = Counting(tiny_model.tokenizer)
    engine_side = HfTokenizer(counting)  # type: ignore[arg-type]
    text = "The quick brown fox"
    ids = list(counting(text)["input_ids"])
    remember_encoding(counting, text, ids)  # what ServedModel.count_tokens does
    assert engine_side.encode(text) == ids and counting.calls == 1
    assert engine_side.encode(text + "!") == list(tiny_model.tokenizer(text + "!")["input_ids"])
    assert counting.calls == 2  # another text: tokenized
    assert recall_encoding(object(), text) is None  # another tokenizer: not its ids


async def test_a_request_never_sees_another_requests_ids(tiny_model):
    text = "Hello world"

    async def validate():
        remember_encoding(tiny_model.tokenizer, text, [9, 9, 9])
        await asyncio.sleep(0.01)
        return recall_encoding(tiny_model.tokenizer, text)

    async def other():
        await asyncio.sleep(0.005)
        return recall_encoding(tiny_model.tokenizer, text)

    mine, theirs = await asyncio.gather(validate(), other())
    assert mine == [9, 9, 9] and theirs is None


def test_outside_a_task_nothing_is_remembered(tiny_model):
    # a box set in a long-lived context (the main thread's, a server's start-up) would be every later
    # task's: so only a task keeps one
    remember_encoding(tiny_model.tokenizer, "Hello", [1, 2])
    assert recall_encoding(tiny_model.tokenizer, "Hello") is None


class Recording:
    """A transformers tokenizer that records the thread of each call."""

    def __init__(self, hf) -> None:
        self.hf, self.threads = hf, []

    def __call__(self, text, **kwargs):
        self.threads.append(threading.current_thread().name)
        return self.hf(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


async def test_validation_counts_on_the_tokenizer_thread_and_the_engine_reuses_its_ids(tiny_model):
    recording = Recording(tiny_model.tokenizer)
    text = "The quick brown fox"

    def count(text: str) -> int:  # what a protocol's validation does (Served.count_tokens)
        ids = list(recording(text)["input_ids"])
        remember_encoding(recording, text, ids)
        return len(ids)

    length = await tokenizing(count, text)
    assert length == len(tiny_model.tokenizer(text)["input_ids"])
    assert recording.threads == ["lmiserve-tokenize_0"] and threading.current_thread().name == "MainThread"
    engine_side = HfTokenizer(recording)  # type: ignore[arg-type]
    assert engine_side.recalls(text)  # remembered in the thread, recalled by this task
    assert engine_side.encode(text) == list(tiny_model.tokenizer(text)["input_ids"])
    assert len(recording.threads) == 1  # not tokenized again


async def test_the_engine_tokenizes_a_prompt_no_validation_counted_off_the_event_loop(tiny_model):
    recording = Recording(tiny_model.tokenizer)
    loaded = dataclasses.replace(tiny_model, tokenizer=recording)
    engine = create_engine(loaded, EngineConfig())
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=3, ignore_eos_token=True)
        events = [e async for e in engine.generate(GenerationRequest("Hello there", params))]
    finally:
        await engine.stop()
    assert sum(e.token is not None for e in events) == 3
    assert recording.threads == ["lmiserve-tokenize_0"]


async def test_a_prompt_the_tokenizer_thread_refuses_is_a_4xx_counted_as_rejected(tiny_model):
    engine = create_engine(tiny_model, EngineConfig(), max_input_len=4)
    rejected = []

    class Observer:
        def on_rejected(self, exc):
            rejected.append(exc)

    engine.add_observer(Observer())  # type: ignore[arg-type]
    engine.start()
    try:
        with pytest.raises(InvalidRequest, match="too long"):
            [e async for e in engine.generate(GenerationRequest("one two three four five six seven", SamplingParams()))]
    finally:
        await engine.stop()
    assert len(rejected) == 1


async def test_prepare_refuses_what_submit_would_and_generate_tokenizes_nothing_again(tiny_model):
    """`prepare` (what a protocol calls before a stream's 200) encodes and checks the request as `submit`
    would: a prompt and max_new_tokens larger than the whole KV pool is refused there, counted as
    rejected once; a request it accepts is not tokenized again by `generate`."""
    recording = Recording(tiny_model.tokenizer)
    loaded = dataclasses.replace(tiny_model, tokenizer=recording)
    per_block = 4 * 2 * 2 * 16 * 2 * 4  # (and on CUDA the decode graphs' block beside the pool's 8)
    config = EngineConfig(block_size=4, kv_cache_memory_bytes=per_block * (8 + scratch_blocks(tiny_model)))
    engine = create_engine(loaded, config)
    assert engine.pool is not None and engine.pool.num_blocks == 8  # 32 tokens
    rejected, submitted = [], []

    class Observer:
        def on_rejected(self, exc):
            rejected.append(exc)

        def on_submitted(self, prompt_tokens, sequences):
            submitted.append(prompt_tokens)

        def on_step(self, step):
            pass

        def on_finished(self, request):
            pass

    engine.add_observer(Observer())
    engine.start()
    try:
        too_large = GenerationRequest("Hello there", SamplingParams(max_new_tokens=30))
        with pytest.raises(InvalidRequest, match="more than the whole KV cache holds"):
            await engine.prepare(too_large)
        assert len(rejected) == 1 and engine.num_waiting == 0
        request = GenerationRequest("Good morning", SamplingParams(max_new_tokens=3, ignore_eos_token=True))
        await engine.prepare(request)
        events = [e async for e in engine.generate(request)]
    finally:
        await engine.stop()
    assert sum(e.token is not None for e in events) == 3
    assert len(recording.threads) == 2  # the refused prompt, then the accepted one once
    assert len(rejected) == 1 and len(submitted) == 1


async def test_prepare_refuses_a_prompt_beyond_the_context_batch_invariant(tiny_model):
    engine = create_engine(tiny_model, EngineConfig(batch_invariant=True))
    request = GenerationRequest("Hello there", SamplingParams(max_new_tokens=tiny_model.max_context))
    with pytest.raises(InvalidRequest, match="context length"):
        await engine.prepare(request)
