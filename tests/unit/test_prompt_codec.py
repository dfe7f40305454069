"""PromptCodec's limits: a prompt too long to possibly fit is refused before it is tokenized."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.text.tokenizer import HfTokenizer
from lmiserve.engine.text.validation import PromptCodec


class CountingTokenizer(HfTokenizer):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return super().encode(text)


@pytest.fixture
def codec(tiny_model_dir: Path) -> PromptCodec:
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    return PromptCodec(tokenizer, eos_token_ids={2}, max_context=256, max_input_len=64)


def request(prompt: str, **params) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=2, **params))


def test_a_prompt_longer_than_any_64_tokens_is_refused_untokenized(codec):
    tokenizer = codec.tokenizer
    longest = max(len(t) for t in tokenizer.hf.get_vocab())
    assert tokenizer.max_token_chars == longest and codec.max_prompt_chars == 64 * longest
    huge = "x" * (codec.max_prompt_chars + 1)
    with pytest.raises(InvalidRequest, match=r"characters: more than 64 tokens\) is too long and exceeds limit of 64"):
        codec.encode(request(huge))
    assert tokenizer.encoded == []  # never tokenized


def test_prompts_within_the_bound_are_counted_in_tokens(codec):
    # as many characters as the bound allows, but far more tokens than 64: the token count decides
    text = "a b " * (codec.max_prompt_chars // 4)
    with pytest.raises(InvalidRequest, match=r"Input prompt \(\d+ tokens\) is too long and exceeds limit of 64"):
        codec.encode(request(text))
    assert codec.tokenizer.encoded == [len(text)]
    assert 0 < len(codec.encode(request("hello world"))) <= 64


def test_a_truncated_prompt_is_tokenized_whatever_its_length(codec):
    huge = "hello " * codec.max_prompt_chars
    ids = codec.encode(request(huge, truncate=10))
    assert len(ids) == 10 and codec.tokenizer.encoded == [len(huge)]


def test_bad_words_are_tokenized_without_special_tokens(codec):
    req = request("hello", bad_words=["fox", " brown fox"])
    runnable, ids = codec.encode_request(req)
    assert ids == codec.encode(req) and not req.params.bad_words_ids  # the request stays as built
    hf = codec.tokenizer.hf
    special = set(hf.all_special_ids) | {2}
    params = runnable.params
    assert params.bad_words_ids and runnable.request_id == req.request_id
    for ids in params.bad_words_ids:
        assert ids and not set(ids) & special
    assert [i for i in hf("fox")["input_ids"] if i not in special] in params.bad_words_ids
    assert [i for i in hf("brown fox")["input_ids"] if i not in special] in params.bad_words_ids
    assert codec.runnable(runnable) is runnable  # nothing left to encode


def test_a_request_with_nothing_to_encode_runs_as_it_is(codec):
    req = request("hello")
    assert codec.runnable(req) is req and codec.encoded_params(req.params) is req.params


def test_logit_bias_ids_outside_the_vocabulary_are_refused(codec):
    size = codec.vocab_size
    codec.encode(request("hello", logit_bias={0: 1.0, size - 1: -1.0}))
    with pytest.raises(InvalidRequest, match=rf"`logit_bias` token ids \[{size}\] are outside the vocabulary"):
        codec.encode(request("hello", logit_bias={size: 1.0}))
