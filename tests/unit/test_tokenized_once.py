"""A prompt is tokenized once: the ids a protocol's validation counted are the engine's, for the same
text in the same request's task, and never another task's."""

from __future__ import annotations

import asyncio

from lmiserve.core.tokenizer import recall_encoding, remember_encoding
from lmiserve.engine.tokenizer import HfTokenizer


class Counting:
    """A transformers tokenizer that counts its calls."""

    def __init__(self, hf) -> None:
        self.hf, self.calls = hf, 0

    def __call__(self, text):
        self.calls += 1
        return self.hf(text)


def test_the_engine_reuses_the_ids_validation_counted_for_the_same_text(tiny_model):
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
