"""The tokenizer operations the engine uses, whatever implements them.

A transformers tokenizer is adapted to this protocol by `lmiserve.engine.tokenizer.HfTokenizer`;
tests use small fakes.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

# The last prompt a request's own task tokenized (its text and ids): a protocol that counts a prompt's
# tokens to validate it leaves them here, and the engine's encoding of the same text in the same task
# reuses them, so a prompt is tokenized once. A context variable: each request's task sees only its own.
_last_encoding: ContextVar[tuple[int, str, tuple[int, ...]] | None] = ContextVar("lmiserve_last_encoding", default=None)


def remember_encoding(tokenizer: object, text: str, ids: list[int]) -> None:
    """Record the ids `tokenizer` (the transformers tokenizer object) gave `text`, for this task."""
    _last_encoding.set((id(tokenizer), text, tuple(ids)))


def recall_encoding(tokenizer: object, text: str) -> list[int] | None:
    """The ids this task recorded for exactly `text` with the same `tokenizer`, else None."""
    last = _last_encoding.get()
    if last is None or last[0] != id(tokenizer) or last[1] != text:
        return None
    return list(last[2])


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
