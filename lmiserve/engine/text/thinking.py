"""A thinking budget in the engine (`SamplingParams.thinking`, a `ThinkingBudget`): a sequence counts
the tokens it generates inside its reasoning block and, once the budget is spent, generates the block's
closing tokens whatever the model would have written, then answers freely (or under its grammar, when
one waits for the block's end: `Grammar.after`).

`BudgetTracker` follows the block through the sequence's own text (decoded with the special tokens, so
markers that are special tokens, such as gpt-oss's ``<|end|>``, are seen whatever the request's
`skip_special_tokens`); it reads the block as the protocols' reasoning parser does
(lmiserve.protocols.textgen.reasoning): inside from the first token when `inside`, else opened by a
start marker at the very start of the output (whitespace before it allowed), closed by any end marker.

`ForcedTokens` forces the closing tokens through the grammar mask path: it has a grammar matcher's
interface and allows exactly one token at each step, so the runners, the executors' bitmask and the
sampler need nothing new, and a sequence being forced gets no speculative drafts (as none with a
grammar does). While the block is open, a sequence's drafts are capped so that no step passes the
budget (`BudgetTracker.draft_limit`): speculative decoding stays on while the model thinks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from lmiserve.core.request import ThinkingBudget
from lmiserve.core.tokenizer import Tokenizer
from lmiserve.engine.text.detokenizer import IncrementalDetokenizer
from lmiserve.engine.text.grammar_compiler import GrammarMatcher

_BEFORE, _INSIDE, _DONE = "before", "inside", "done"


class ForcedTokens(GrammarMatcher):
    """A matcher that allows exactly `ids`, one after the other (and never an end of sequence)."""

    def __init__(self, ids: Sequence[int]) -> None:  # no llguidance matcher underneath
        self.ids = list(ids)
        self.at = 0

    @property
    def done(self) -> bool:
        return self.at >= len(self.ids)

    def fill_mask(self, data_ptr: int, nbytes: int) -> None:
        ctypes.memset(data_ptr, 0, nbytes)
        if self.done:
            return
        token = self.ids[self.at]
        word = (token // 32) * 4
        if 0 <= word < nbytes:
            ctypes.c_uint32.from_address(data_ptr + word).value = 1 << (token % 32)

    def accept(self, token_id: int) -> bool:
        if self.done or self.ids[self.at] != token_id:
            return False
        self.at += 1
        return True

    @property
    def is_complete(self) -> bool:
        return False

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def error(self) -> str:
        return "not the next token of the forced end of the thinking"


class BudgetTracker:
    """One sequence's reasoning block and how many of its tokens were spent."""

    def __init__(self, budget: ThinkingBudget, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.budget = budget
        self.state = _INSIDE if budget.inside or not budget.starts else _BEFORE
        self.used = 0  # tokens generated inside the block
        self._text = ""  # before the block: the output so far; inside it: its end (a marker may be starting)
        self._keep = max(len(end) for end in budget.ends) - 1 if budget.ends else 0
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False)

    @property
    def open(self) -> bool:
        """The block is open or may still open: the budget may yet apply."""
        return self.state != _DONE

    @property
    def spent(self) -> bool:
        """The block is open and its budget spent: its closing tokens are due."""
        return self.state == _INSIDE and self.used >= self.budget.tokens

    def may_spend(self, tokens: int) -> bool:
        """Whether the next `tokens` tokens may spend the budget (its end then forced on the token after
        them): inside the block, when they reach it; before it, when the block may open with the first of
        them and the others reach it."""
        if self.state == _INSIDE:
            return self.used + tokens >= self.budget.tokens
        return self.state == _BEFORE and tokens - 1 >= self.budget.tokens

    def draft_limit(self) -> int:
        """The most drafts one step may verify without passing the budget (a step gives a sequence up to
        one token more than its drafts): inside the block, the tokens left but the step's own; before it,
        the budget itself (the block may open with the step's first token)."""
        if self.state == _INSIDE:
            return max(0, self.budget.tokens - self.used - 1)
        return self.budget.tokens

    def feed(self, token_id: int) -> None:
        """Take one generated token (counted when the block was open before it)."""
        if self.state == _INSIDE:
            self.used += 1
        text = self._detok.add(token_id)
        if not text or self.state == _DONE:
            return
        if self.state == _BEFORE:
            seen = self._text + text
            stripped = seen.lstrip()
            start = next((s for s in self.budget.starts if stripped.startswith(s)), None)
            if start is None:
                if any(s.startswith(stripped) for s in self.budget.starts):
                    self._text = seen  # only whitespace and maybe a marker's start so far
                else:
                    self.state = _DONE  # the output starts with something else: no block
                return
            self.state, self._text, text = _INSIDE, "", stripped[len(start) :]
        seen = self._text + text
        if any(end in seen for end in self.budget.ends):
            self.state = _DONE
        else:
            self._text = seen[len(seen) - self._keep :] if self._keep else ""

    def closing(self, output_ids: Sequence[int]) -> ForcedTokens:
        """The forced closing tokens; those of them the output already ends with are not forced again
        (the model had started to write the end marker when the budget ran out)."""
        forced = ForcedTokens(self.budget.close_ids)
        ids = forced.ids
        for n in range(min(len(ids) - 1, len(output_ids)), 0, -1):
            if list(output_ids[len(output_ids) - n :]) == ids[:n]:
                forced.at = n
                break
        return forced
