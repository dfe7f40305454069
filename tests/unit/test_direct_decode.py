"""The engine's decode of a fast tokenizer skips transformers' per-call wrapper (engine/text/tokenizer.py,
`direct_decode`; issue #39, the host-side cost of a step): the text is the same as transformers' `decode`
for every window of ids, special tokens skipped or kept; a tokenizer whose decode transformers changes (its
class overrides it, or a clean-up of spaces that applies) keeps transformers' decode."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmiserve.engine.text.tokenizer import HfTokenizer, direct_decode


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def windows(vocab: int, specials: list[int], count: int = 400) -> list[list[int]]:
    """Random id lists (1 to 12 ids, special ones among them), the same every run."""
    rng = random.Random(39)
    pool = list(range(vocab)) + specials * 20
    return [[rng.choice(pool) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def same_as_transformers(tokenizer) -> None:
    ours = HfTokenizer(tokenizer)
    for ids in windows(len(tokenizer), list(tokenizer.all_special_ids)):
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_the_tiny_tokenizer_decodes_directly_and_the_same(tiny_tokenizer):
    assert direct_decode(tiny_tokenizer) is not None
    same_as_transformers(tiny_tokenizer)


def test_smollm_decodes_directly_and_the_same(smollm_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    assert direct_decode(tokenizer) is not None
    same_as_transformers(tokenizer)


def test_a_bpe_tokenizer_with_clean_up_decodes_directly(tiny_tokenizer):
    """Llama 3's tokenizer_config says clean_up_tokenization_spaces=true; transformers skips it for BPE."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path, clean_up_tokenization_spaces=True)
    assert tokenizer.clean_up_tokenization_spaces
    assert direct_decode(tokenizer) is not None
    same_as_transformers(tokenizer)


def test_a_wordpiece_clean_up_keeps_transformers_decode():
    """A clean-up that applies (WordPiece: " ." becomes ".") is transformers' to do."""
    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, ".": 4, "!": 5, "'": 6, "s": 7, "##s": 8}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )
    assert direct_decode(tokenizer) is None
    assert HfTokenizer(tokenizer).decode([2, 3, 4, 6, 7]) == tokenizer.decode([2, 3, 4, 6, 7]) == "hello world.'s"
    same_as_transformers(tokenizer)


def test_a_tokenizer_class_with_its_own_decode_keeps_it(tiny_tokenizer):
    class Shouting(type(tiny_tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    tokenizer = Shouting.from_pretrained(tiny_tokenizer.name_or_path)
    assert direct_decode(tokenizer) is None
    ids = tiny_tokenizer("Hello world")["input_ids"]
    assert HfTokenizer(tokenizer).decode(ids) == tiny_tokenizer.decode(ids).upper()
