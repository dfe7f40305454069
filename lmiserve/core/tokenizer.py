"""The tokenizer operations the engine uses, whatever implements them.

A transformers tokenizer is adapted to this protocol by `lmiserve.engine.tokenizer.HfTokenizer`;
tests use small fakes.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, with the special tokens the model expects (e.g. BOS)."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str:
        """The text of these ids (incomplete UTF-8 at the end decodes as U+FFFD)."""
        ...

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens (BOS, EOS, padding, ...)."""
        ...

    def __len__(self) -> int:
        """Vocabulary size including added tokens."""
        ...
