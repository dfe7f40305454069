"""A transformers tokenizer as the engine's `Tokenizer` (lmiserve.core.tokenizer)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from lmiserve.core.tokenizer import recall_encoding, remember_encoding

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def direct_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The tokenizers library's own `decode` when transformers' `decode` of one id list returns just what
    it returns: a fast tokenizer whose class overrides neither `decode` nor `_decode`, and whose clean-up
    of spaces does not apply (off, or skipped for a BPE model as transformers skips it). None otherwise.
    transformers' per-call conversions cost about four times the decode itself, and the detokenizer
    decodes twice a token (benchmarks/README.md, "host-side cost of a step")."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode
        return None
    cls, backend = type(tokenizer), getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or backend is None:
        return None
    if cls.decode is not Base.decode or cls._decode is not TokenizersBackend._decode:
        return None
    if tokenizer.clean_up_tokenization_spaces and not (
        type(backend.model).__name__ == "BPE"
        and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    ):
        return None
    decode: Callable[..., str] = backend.decode
    return decode


class HfTokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = tokenizer
        self._direct = direct_decode(tokenizer)  # None: transformers' decode

    def encode(self, text: str) -> list[int]:
        """The text's ids; those this request's validation already counted, when it is the same text.
        What it tokenizes is remembered for the request too (`AsyncEngine.prepare` encodes before
        `generate` does: the prompt is tokenized once)."""
        ids = recall_encoding(self.hf, text)
        if ids is None:
            ids = list(self.hf(text)["input_ids"])
            remember_encoding(self.hf, text, ids)
        return ids

    def recalls(self, text: str) -> bool:
        """Whether this request's validation already counted `text` (`encode` then tokenizes nothing)."""
        return recall_encoding(self.hf, text) is not None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._direct is not None:
            return self._direct(ids, skip_special_tokens=skip_special_tokens)
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):  # only a batch of id lists decodes to a list
            raise TypeError(f"decode of one id list returned {type(text).__name__}")
        return text

    def decode_stream(self, context: list[int], skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """The tokenizers library's incremental decoder (`tokenizers.decoders.DecodeStream`) after the ids of
        `context`, as a function of the next id (its new text, None while held back), where `decode` is
        the library's own (`direct_decode`); None otherwise. One call a token in the library instead of
        two decodes (engine/text/detokenizer.py)."""
        if self._direct is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):  # a tokenizers without it (before 0.21) or without its context (`ids`)
            return None
        step: Callable[[int], str | None] = functools.partial(stream.step, self.hf._tokenizer)
        return step

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids or [])

    def __len__(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of a text one token can stand for: its longest vocabulary string (added
        tokens included; a byte-level token's string has one character a byte). A text longer than N
        times this has more than N tokens, whatever it says (`PromptCodec` refuses it untokenized)."""
        return max((len(token) for token in self.hf.get_vocab()), default=1)
