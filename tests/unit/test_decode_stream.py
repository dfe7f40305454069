"""The detokenizer on the tokenizers library's `DecodeStream` (engine/text/tokenizer.py `decode_stream`,
engine/text/detokenizer.py; issue #39, the host-side cost of a step): each token's text, and the text held
back at the end, are those of the rule in Python (two decodes of a window a token) for every tokenizer the
engine decodes directly: byte-level BPE (the tiny one, SmolLM2's, one with added tokens) and a SentencePiece
one with byte fallback (its decoder drops the leading space of a decode). Random ids make the hard cases
(a character's bytes across tokens, invalid bytes, special tokens), skipped or kept. Where the library
refuses a token the rule in Python goes on from there; a tokenizer decoded through transformers keeps it."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from helpers.tiny_model import build_thinking_tokenizer, training_corpus
from lmiserve.engine.text.detokenizer import IncrementalDetokenizer
from lmiserve.engine.text.tokenizer import HfTokenizer

SAMPLE = "héllo wörld — naïve café 日本語 🎉 and  spaces\n\nlines"


class WindowsOnly:
    """The same tokenizer without `decode_stream`: the rule in Python."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.decode = tokenizer.decode


def run(tokenizer, prompt_ids: list[int], ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
    texts = [detok.add(i) for i in ids]
    return texts, detok.flush()


def same_as_windows(tokenizer: HfTokenizer, cases: int = 300) -> None:
    """Random prompts and completions (special ids among them), the same every run."""
    rng = random.Random(39)
    pool = list(range(len(tokenizer))) + tokenizer.all_special_ids * 20
    windows = WindowsOnly(tokenizer)
    for _ in range(cases):
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert run(tokenizer, prompt, ids, skip) == run(windows, prompt, ids, skip), (prompt, ids, skip)
    # and real text after a real prompt, token by token
    ids = tokenizer.encode(SAMPLE)
    for skip in (True, False):
        assert run(tokenizer, ids[:5], ids[5:], skip) == run(windows, ids[:5], ids[5:], skip)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE over "▁"-joined words of the English corpus, the bytes of any other
    character as <0xNN> tokens, a decoder that turns "▁" into spaces and strips the first."""
    specials = ["<unk>", "<s>", "</s>"]
    english = [text for text in training_corpus() if text.isascii()]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    learner.train_from_iterator(english, trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab = dict(learned["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = learner.normalizer
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> HfTokenizer:
    return HfTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_the_tiny_tokenizer_streams_what_the_windows_give(tiny):
    assert tiny.decode_stream([], True) is not None
    same_as_windows(tiny)


def test_smollm_streams_what_the_windows_give(smollm_dir):
    tokenizer = HfTokenizer(AutoTokenizer.from_pretrained(smollm_dir))
    assert tokenizer.decode_stream([], True) is not None
    same_as_windows(tokenizer, cases=150)


def test_added_tokens_stream_what_the_windows_give():
    tokenizer = HfTokenizer(build_thinking_tokenizer())  # <think> and </think> are added tokens
    assert tokenizer.decode_stream([], False) is not None
    same_as_windows(tokenizer)


def test_a_sentencepiece_tokenizer_with_byte_fallback_streams_what_the_windows_give():
    tokenizer = HfTokenizer(sentencepiece_tokenizer())
    assert tokenizer.decode_stream([], True) is not None
    assert "<0x" in "".join(tokenizer.hf.convert_ids_to_tokens(tokenizer.encode("日本語 🎉")))  # bytes fall back
    same_as_windows(tokenizer)
    ids = tokenizer.encode(SAMPLE)  # the leading space a decode drops is the context's to keep
    cut = len(tokenizer.encode("héllo"))
    texts, tail = run(tokenizer, ids[:cut], ids[cut:], True)
    assert "".join(texts) + tail == SAMPLE[len("héllo") :]


def test_the_library_decodes_each_token_and_python_none(tiny, monkeypatch):
    """On the stream each token is one call into the library: no window is decoded in Python (the context,
    once, when the detokenizer starts: whether it ends inside a character)."""
    decoded: list[list[int]] = []
    original = HfTokenizer.decode
    monkeypatch.setattr(
        HfTokenizer, "decode", lambda self, ids, **kw: decoded.append(list(ids)) or original(self, ids, **kw)
    )
    ids = tiny.encode(SAMPLE)
    streamed = run(tiny, ids[:4], ids[4:], True)
    assert decoded == [ids[:4]]
    assert streamed == run(WindowsOnly(tiny), ids[:4], ids[4:], True)
    assert "".join(streamed[0]) + streamed[1] == original(tiny, ids[4:], skip_special_tokens=True)


def test_a_token_the_library_refuses_is_decoded_by_the_windows_from_there(tiny):
    """DecodeStream raises on a window whose text does not extend the last one's: the rule in Python takes
    over at that token, with the same offsets, and the texts are the same."""
    ids = tiny.encode(SAMPLE)
    calls = 0

    class Refusing(HfTokenizer):
        def decode_stream(self, context, skip_special_tokens):
            stream = super().decode_stream(context, skip_special_tokens)
            assert stream is not None

            def step(token_id: int) -> str | None:
                nonlocal calls
                calls += 1
                if calls == 7:
                    raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what the library raises
                return stream(token_id)

            return step

    refusing = Refusing(tiny.hf)
    assert run(refusing, ids[:4], ids[4:], True) == run(WindowsOnly(tiny), ids[:4], ids[4:], True)
    assert calls == 7  # the stream was left at the refusal


def test_a_tokenizer_decoded_through_transformers_has_no_stream():
    """A clean-up that applies (WordPiece) is transformers' to do: the windows decode through it."""
    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, ".": 4}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = HfTokenizer(
        PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
        )
    )
    assert tokenizer.decode_stream([], True) is None
    texts, tail = run(tokenizer, [], [2, 3, 4], True)
    assert "".join(texts) + tail == "hello world."


def test_a_tokenizers_without_the_streams_context_keeps_the_windows(tiny, monkeypatch):
    """tokenizers 0.21's DecodeStream takes no context ids (lmiserve asks for tokenizers>=0.21)."""
    import tokenizers.decoders

    class Older:
        def __init__(self, skip_special_tokens: bool = False) -> None:
            pass

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", Older)
    assert tiny.decode_stream([1, 2], True) is None
    ids = tiny.encode(SAMPLE)
    assert run(tiny, ids[:4], ids[4:], True) == run(WindowsOnly(tiny), ids[:4], ids[4:], True)
