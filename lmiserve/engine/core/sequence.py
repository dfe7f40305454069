"""One generated sequence: its place in the batch, its tokens, and the rules that end it.

Pure Python (no torch): the scheduler moves sequences between states, the runner fills in sampled
tokens, and :meth:`Sequence.on_token` turns each token into the `StepEvent` clients receive.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import SamplingParams
from lmiserve.core.tokenizer import Tokenizer
from lmiserve.engine.core.kv_blocks import BlockTable
from lmiserve.engine.text.detokenizer import IncrementalDetokenizer
from lmiserve.engine.text.grammar_compiler import GrammarMatcher
from lmiserve.engine.text.stop import StopMatcher
from lmiserve.engine.text.thinking import BudgetTracker, ForcedTokens

if TYPE_CHECKING:
    from lmiserve.engine.lora.adapters import LoraAdapter
    from lmiserve.engine.text.images import ImageInputs


class SeqStatus(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        special_token_ids: set[int],
        seed: int | None,
        index: int = 0,
        arrival: float = 0.0,
        grammar: GrammarMatcher | None = None,
        priority: int = 0,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.priority = priority  # lower is admitted first (vLLM's meaning)
        self.status = SeqStatus.WAITING
        self.slot: int | None = None
        self.block_table: BlockTable | None = None  # with the block scheduler: its blocks in the KV pool
        self.preemptions = 0  # times the block scheduler gave its blocks away (it then recomputes them)
        self.prompt_counted = 0  # prompt tokens computed and counted in the stats (none counted twice)
        self.cache_salt: str | None = None  # vLLM's cache_salt: shares cached blocks only with the same salt
        self.adapter: LoraAdapter | None = None  # its LoRA adapter (engine/lora/adapters.py; None: the base model)
        self.images: ImageInputs | None = None  # a VLM prompt's images (engine/text/images.py; None: text only)
        self.kv_len = 0  # positions of this sequence written into the KV cache
        # planned in steps whose results are not applied yet (overlap scheduling plans a step while the one
        # before it runs): KV positions, and tokens those steps sample (engine/core/block_scheduler.py)
        self.inflight_tokens = 0
        self.inflight_samples = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.output_ids: list[int] = []
        self.cumulative_logprob = 0.0
        self.prefill_tokens: list[Token] = []
        self.prefill_ranks: list[int | None] = []  # with params.prompt_top_n set
        self.prefill_top: list[tuple[Token, ...] | None] = []
        self.abort_requested = False
        # speculative decoding (engine/speculative/proposers.py): the drafts proposed after its last step, its
        # running acceptance, and how long its drafts pause after a low one
        self.drafts: list[int] = []
        self.spec_acceptance: float | None = None
        self.spec_pause = 0
        self.spec_backoff = 0
        self._grammar = grammar  # this sequence's own matcher when its output is constrained
        # `Grammar.after`: the matcher waits here (no mask) until the generated text contains that marker
        constraint = getattr(params, "grammar", None)
        self._grammar_after: str = getattr(constraint, "after", "") if grammar is not None else ""
        self._deferred: GrammarMatcher | None = None
        self._gate_tail = ""  # the end of the generated text, while waiting for `_grammar_after`
        if self._grammar_after:
            self._deferred, self._grammar = grammar, None
        # a thinking budget (engine/text/thinking.py): the block followed until its budget is spent, then its
        # closing tokens forced (masking every other token, as a grammar does)
        budget = getattr(params, "thinking", None)
        self._thinking: BudgetTracker | None = None
        self._forcing: ForcedTokens | None = None
        if budget is not None and budget.close_ids:
            self._thinking = BudgetTracker(budget, tokenizer, prompt_ids)
            self._force_when_spent()
        self.finish_reason: FinishReason | None = None
        # monotonic times the engine stamps (lmiserve.core.stats): admitted, first and latest token, end
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        self._tokenizer = tokenizer
        self._eos: set[int] = set() if params.ignore_eos_token else set(eos_token_ids)
        self._stop_ids = set(params.stop_token_ids)
        self._special = special_token_ids
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._stop = StopMatcher(params.stop_sequences, params.include_stop_str_in_output)
        self._texts: list[str] = []
        self._stop_reason: str | int | None = None  # what ended it with STOP_SEQUENCE

    # ---- state -----------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def kv_next(self) -> int:
        """The first position no planned step computes: where this sequence's next step starts."""
        return self.kv_len + self.inflight_tokens

    @property
    def decoding(self) -> bool:
        """Whether its next step decodes: it runs, or the prompt's last chunk is in flight."""
        return self.status is SeqStatus.RUNNING or (self.status is SeqStatus.PREFILL and self.inflight_samples > 0)

    @property
    def may_constrain(self) -> bool:
        """Whether a token may be masked (a grammar, one waiting for its marker, or a thinking budget): its
        next step's mask then depends on the token before it, so that step is never planned ahead."""
        return self._thinking is not None or self.may_constrain_after(0)

    def may_constrain_after(self, tokens: int) -> bool:
        """Whether the token after the `tokens` still in flight may be masked: a grammar (or one waiting for
        its marker, which any of them may complete), a forced end, or a thinking budget they may spend."""
        if self._grammar is not None or self._deferred is not None or self._forcing is not None:
            return True
        return self._thinking is not None and self._thinking.may_spend(tokens)

    @property
    def prefill_remaining(self) -> int:
        return self.prompt_len - self.kv_len if self.status is SeqStatus.PREFILL else 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def grammar(self) -> GrammarMatcher | None:
        """The matcher that masks this sequence's next token (None: unconstrained): the forced end of its
        thinking while a budget forces it, else its grammar once that applies."""
        return self._forcing if self._forcing is not None else self._grammar

    @property
    def draft_limit(self) -> int | None:
        """The most drafts one step may verify for this sequence without passing its thinking budget
        (None: no limit)."""
        return self._thinking.draft_limit() if self._thinking is not None else None

    def token(self, token_id: int, logprob: float | None, text: str | None = None) -> Token:
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return Token(token_id, text, logprob, token_id in self._special)

    def add_prompt_logprobs(
        self,
        start: int,
        logprobs: list[float | None],
        ranks: list[int | None] | None = None,
        tops: list[list[tuple[int, float]] | None] | None = None,
    ) -> None:
        """Record prompt tokens from `start` with the logprob the model gave each (first: None) and, when
        given, each one's rank and the top tokens at its position."""
        for offset, lp in enumerate(logprobs):
            pos = start + offset
            self.prefill_tokens.append(self.token(self.prompt_ids[pos], lp))
            self.prefill_ranks.append(ranks[offset] if ranks is not None else None)
            top = tops[offset] if tops is not None else None
            self.prefill_top.append(tuple(self.token(i, v) for i, v in top) if top is not None else None)

    @property
    def _prompt_top(self) -> bool:
        return self.params.decoder_input_details and self.params.prompt_top_n is not None

    # ---- events ------------------------------------------------------------------------------------
    def on_token(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None = None) -> StepEvent:
        """Take one sampled token; return its event (with `finish` set when this token ends the sequence)."""
        self.output_ids.append(token_id)
        self.cumulative_logprob += logprob
        reason: FinishReason | None = None
        # a stop token's own text (a stop token id's, or EOS's where special tokens are kept) is left out
        # unless asked (vLLM's: the detokenizer never sees it)
        stops = token_id in self._stop_ids or token_id in self._eos
        hidden = stops and not self.params.include_stop_str_in_output
        text = "" if hidden else self._detok.add(token_id)
        error = self._advance_grammar(token_id)
        if self._deferred is not None:
            self._open_gate(token_id, text)
        if self._forcing is not None and self._forcing.done:
            self._forcing = None  # the block is closed: the answer follows
        if self._thinking is not None:
            self._thinking.feed(token_id)
            self._force_when_spent()
        if error is not None:
            reason = FinishReason.ERROR
        elif token_id in self._eos:
            reason = FinishReason.EOS_TOKEN
        elif token_id in self._stop_ids:
            reason = FinishReason.STOP_SEQUENCE
            self._stop_reason = token_id
        text, stopped = self._stop.feed(text, len(self.output_ids) > self.params.min_new_tokens)
        if stopped and reason is None:
            reason = FinishReason.STOP_SEQUENCE
            self._stop_reason = self._stop.matched
        if reason is None and (grammar := self.grammar) is not None and grammar.is_stopped:
            reason = FinishReason.EOS_TOKEN  # the grammar is complete and nothing may follow
        if reason is None and len(self.output_ids) >= self.params.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and not stopped:
            tail, _ = self._stop.feed(self._detok.flush())
            text += tail + self._stop.flush()
        self._texts.append(text)
        top_tokens = tuple(self.token(i, lp) for i, lp in top) if top is not None else None
        return StepEvent(
            token=self.token(token_id, logprob, text),
            top_tokens=top_tokens,
            finish=self._finish(reason, error) if reason is not None else None,
            index=self.index,
        )

    def _advance_grammar(self, token_id: int) -> str | None:
        """Advance the matcher by `token_id`; the error when the grammar refuses it (never with a
        correct mask: the token was sampled from the allowed ones)."""
        if self.grammar is None or self.grammar.accept(token_id):
            return None
        return f"the generated token {token_id} does not follow the grammar: {self.grammar.error}"

    def _force_when_spent(self) -> None:
        """Force the closing tokens once the budget is spent, unless a grammar already constrains every
        token (it decides); stop following a block that closed (or never opened)."""
        thinking = self._thinking
        if thinking is None:
            return
        if thinking.spent:
            if self._grammar is None:
                self._forcing = thinking.closing(self.output_ids)
            self._thinking = None
        elif not thinking.open:
            self._thinking = None

    def _open_gate(self, token_id: int, text: str) -> None:
        """Start the deferred grammar once the generated text (this token's included) holds the marker."""
        if not text:  # a token held back by the detokenizer (part of a character): its own text
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        seen = self._gate_tail + text
        if self._grammar_after in seen:
            self._grammar, self._deferred = self._deferred, None
        else:
            self._gate_tail = seen[-len(self._grammar_after) :]

    def end(self, reason: FinishReason, error: str | None = None) -> StepEvent:
        """End without a token (error or abort)."""
        return StepEvent(token=None, finish=self._finish(reason, error), index=self.index)

    def _finish(self, reason: FinishReason, error: str | None = None) -> Finish:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        return Finish(
            reason=reason,
            generated_text="".join(self._texts),
            generated_tokens=len(self.output_ids),
            prompt=self.prompt,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens,
            seed=self.seed,
            prefill=tuple(self.prefill_tokens) if self.params.decoder_input_details else None,
            prefill_ranks=tuple(self.prefill_ranks) if self._prompt_top else None,
            prefill_top=tuple(self.prefill_top) if self._prompt_top else None,
            error=error,
            stop_reason=self._stop_reason if reason is FinishReason.STOP_SEQUENCE else None,
        )
