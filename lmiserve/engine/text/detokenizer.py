"""Incremental detokenization that never emits half a UTF-8 character.

The text of token *i* is the difference between decoding a short window ending at *i* and the same
window without *i*. When the decoded window ends in U+FFFD (an incomplete UTF-8 sequence) nothing is
emitted and the bytes are carried to the next token, so the concatenation of all token texts equals
the decoded completion. A few prompt tokens are kept as left context so tokenizers that drop a
leading space at the start of a decode (SentencePiece) still give the right text.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmiserve.core.tokenizer import Tokenizer

_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes ("" while held back)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            new_text = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character decodes as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]
