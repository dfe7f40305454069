"""Incremental detokenization: never half a character, and token texts concatenate to the decode.

Checked with a fake byte tokenizer and with real byte-level BPE tokenizers: the tiny one trained in
`tiny_model_dir` (multi-byte characters stay split across tokens there) and SmolLM2's.
"""

from __future__ import annotations

import pytest
from fakes import EOS, ByteTokenizer

from lmiserve.engine.text.detokenizer import IncrementalDetokenizer

SAMPLE = "héllo wörld — naïve café 日本語 🎉"
REPLACEMENT = "\ufffd"


def run(tokenizer, prompt_ids, ids, skip_special_tokens=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    texts = [detok.add(i) for i in ids]
    return texts, detok.flush()


def check_incremental(tokenizer, prompt_ids, ids) -> list[str]:
    texts, tail = run(tokenizer, prompt_ids, ids)
    assert tail == ""
    assert not any(REPLACEMENT in t for t in texts), texts
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True)
    # after every token the emitted text is the decoded text without its incomplete last character
    for k in range(1, len(ids) + 1):
        emitted = "".join(texts[:k])
        decoded = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if decoded.endswith(REPLACEMENT):
            assert texts[k - 1] == "", (k, texts[k - 1])
            assert decoded.startswith(emitted)
        else:
            assert emitted == decoded, (k, emitted, decoded)
    return texts


# --- fake byte tokenizer ----------------------------------------------------------------------------


def test_bytewise_tokens_emit_whole_characters_only():
    tok, ids = ByteTokenizer.for_text(SAMPLE, lambda b: [b[i : i + 1] for i in range(len(b))])
    texts = check_incremental(tok, [], ids)
    assert [t for t in texts if t] == list(SAMPLE)  # exactly one character per completing byte


def test_tokens_straddling_character_boundaries():
    # 3-byte pieces cut 2- and 4-byte characters in the middle: a token may finish one and start another
    tok, ids = ByteTokenizer.for_text(SAMPLE, lambda b: [b[i : i + 3] for i in range(0, len(b), 3)])
    check_incremental(tok, [ids[0]], ids)


def test_special_tokens_are_skipped_or_kept():
    tok, ids = ByteTokenizer.for_text("ab", lambda b: [b[:1], b[1:]])
    texts, tail = run(tok, [], [ids[0], EOS, ids[1]], skip_special_tokens=True)
    assert texts == ["a", "", "b"] and tail == ""
    texts, tail = run(tok, [], [ids[0], EOS, ids[1]], skip_special_tokens=False)
    assert texts == ["a", "</s>", "b"] and tail == ""


def test_flush_returns_an_incomplete_character_as_replacement():
    tok, ids = ByteTokenizer.for_text("a日", lambda b: [b[i : i + 1] for i in range(len(b))])
    texts, tail = run(tok, [], ids[:2])
    assert texts == ["a", ""]
    assert tail == REPLACEMENT


def test_decode_window_stays_short_over_long_generations():
    tok, ids = ByteTokenizer.for_text("日本語 " * 100, lambda b: [b[i : i + 2] for i in range(0, len(b), 2)])
    widths = []

    class Spy:
        def decode(self, ids, skip_special_tokens=False):
            widths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    texts, _ = run(Spy(), [ids[0]] * 20, ids)
    assert "".join(texts) == "日本語 " * 100
    assert max(widths) <= 10  # O(1) work per token, not a decode of the whole completion


def test_prompt_context_does_not_leak_into_output():
    tok, ids = ByteTokenizer.for_text("prompt é|out", lambda b: [b[i : i + 1] for i in range(len(b))])
    cut = len("prompt é|".encode())
    texts, tail = run(tok, ids[:cut], ids[cut:])
    assert "".join(texts) + tail == "out"


# --- real tokenizers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


@pytest.mark.parametrize("prompt", ["", "Hello ", "naïve 日"])
def test_tiny_tokenizer_non_ascii(tiny_tokenizer, prompt: str):
    ids = tiny_tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    prompt_ids = tiny_tokenizer(prompt)["input_ids"]  # with BOS
    texts = check_incremental(tiny_tokenizer, prompt_ids, ids)
    assert "".join(texts) == SAMPLE
    # the tiny tokenizer splits accented letters and CJK into byte tokens: several tokens emit ""
    mid_char = [k for k in range(len(ids)) if tiny_tokenizer.decode(ids[: k + 1]).endswith(REPLACEMENT)]
    assert len(mid_char) >= 10
    assert all(texts[k] == "" for k in mid_char)


def test_tiny_tokenizer_eos_in_the_middle(tiny_tokenizer):
    ids = tiny_tokenizer("café 🎉", add_special_tokens=False)["input_ids"]
    eos = tiny_tokenizer.eos_token_id
    seq = [*ids[:3], eos, *ids[3:]]
    texts, tail = run(tiny_tokenizer, [], seq, skip_special_tokens=True)
    assert "".join(texts) + tail == "café 🎉"
    assert texts[3] == ""


def test_smollm_tokenizer_non_ascii(smollm_tokenizer):
    ids = smollm_tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    prompt_ids = smollm_tokenizer("Say something:")["input_ids"]
    texts = check_incremental(smollm_tokenizer, prompt_ids, ids)
    assert "".join(texts) == SAMPLE
    assert "" in texts  # CJK and emoji span several tokens
    # leading spaces survive (no word-start space dropped at the start of a decode window)
    more = smollm_tokenizer(" and  more text, with   spaces\n\nand lines", add_special_tokens=False)["input_ids"]
    texts = check_incremental(smollm_tokenizer, ids, more)
    assert "".join(texts) == " and  more text, with   spaces\n\nand lines"
