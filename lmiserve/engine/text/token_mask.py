"""The step's token bitmask: the constrained rows' allowed tokens, applied to their logits in place.

A runner gathers the logits rows of the sequences that carry a grammar (rows without one are never
touched), `TokenMask.apply` fills one int32 bitmask for all of them (each row from its sequence's
matcher) and masks the disallowed tokens to -inf in one batched operation. EOS is allowed exactly
where the grammar is complete, whatever the library thinks the model's EOS tokens are.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from lmiserve.engine.text.grammar_compiler import GrammarMatcher

_NEG_INF = float("-inf")
_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)  # 1 << i, as int32


class TokenMask:
    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = [(i // 32, np.uint32(1 << (i % 32))) for i in sorted(eos_token_ids) if 0 <= i < vocab_size]
        self._bitmask = torch.zeros((0, self.words), dtype=torch.int32)

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.zeros((max(rows, 2 * self._bitmask.shape[0]), self.words), dtype=torch.int32)
        return self._bitmask[:rows]

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The bitmask of `matchers` (one row each; bit t of a row set = token t allowed)."""
        bitmask = self._buffer(len(matchers))
        words = bitmask.numpy().view(np.uint32)
        row_bytes = self.words * 4
        base = bitmask.data_ptr()
        for row, matcher in enumerate(matchers):
            matcher.fill_mask(base + row * row_bytes, row_bytes)
            complete = matcher.is_complete
            for word, bit in self.eos:
                if complete:
                    words[row, word] |= bit
                else:
                    words[row, word] &= ~bit
        return bitmask

    def apply(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher]) -> None:
        """Mask `logits` ([len(matchers), vocab], float, CPU or not) in place to what each matcher allows."""
        if matchers:
            apply_bitmask(logits, self.fill(matchers), self.vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray, vocab_size: int) -> None:
    """Mask `logits` ([rows, vocab], float, CPU or not) in place to what `bitmask` ([rows, words] int32,
    on the host; bit t of a row set = token t allowed) allows; tokens past `vocab_size` never are."""
    words = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    rows = words.shape[0]
    vocab = min(logits.shape[-1], vocab_size)
    if sys.byteorder == "little":  # the words' bytes in token order: unpack all rows in one numpy pass
        bits = np.unpackbits(np.invert(words.view(np.uint8)), axis=-1, bitorder="little")
        disallowed = torch.from_numpy(bits).view(torch.bool).to(logits.device, non_blocking=True)
    else:
        device_words = torch.from_numpy(words).to(logits.device, non_blocking=True)
        disallowed = ((device_words.unsqueeze(-1) & _BITS.to(logits.device)) == 0).view(rows, -1)
    logits[:, :vocab].masked_fill_(disallowed[:, :vocab], _NEG_INF)
    if logits.shape[-1] > vocab:  # logits wider than the grammar's vocabulary: never allowed
        logits[:, vocab:] = _NEG_INF
