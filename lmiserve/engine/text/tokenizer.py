"""A transformers tokenizer as the engine's `Tokenizer` (lmiserve.core.tokenizer)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from lmiserve.core.tokenizer import recall_encoding, remember_encoding

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HfTokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = tokenizer

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
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):  # only a batch of id lists decodes to a list
            raise TypeError(f"decode of one id list returned {type(text).__name__}")
        return text

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
