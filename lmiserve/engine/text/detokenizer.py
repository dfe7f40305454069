"""Incremental detokenization that never emits half a UTF-8 character.

The text of token *i* is the difference between decoding a short window ending at *i* and the same
window without *i*. When the decoded window ends in U+FFFD (an incomplete UTF-8 sequence) nothing is
emitted and the bytes are carried to the next token, so the concatenation of all token texts equals
the decoded completion. A few prompt tokens are kept as left context so tokenizers that drop a
leading space at the start of a decode (SentencePiece) still give the right text.

Where the tokenizer offers it (`decode_stream`: the tokenizers library's `DecodeStream`, the same rule in
Rust), each token is one call into the library instead of two decodes; the window's offsets are kept all
the same, for `flush` and for the rule in Python should the library refuse a token (it raises on a window
whose text does not extend the last one's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lmiserve.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        opener = getattr(tokenizer, "decode_stream", None)
        self._stream: Callable[[int], str | None] | None = None
        # a context cut inside a character keeps the windows: the library would repeat the context's text
        if opener is not None and not self._decode(self._ids).endswith(_REPLACEMENT):
            self._stream = opener(self._ids, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes ("" while held back)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream(token_id)
            except Exception as exc:  # noqa: BLE001 - the library's refusal: the same rule in Python from here
                log.debug("DecodeStream refused token %d (%s): decoding windows from here", token_id, exc)
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                return text
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
