"""Per-token events: the one output type of the engine, consumed by every formatter.

Each sequence yields one `StepEvent` per generated token; the last event of a sequence has `finish`
set (it may carry no token when the sequence ended by an error or an abort). A stream that ends
without an event carrying `finish` is an error, not a silent truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ERROR = "error"
    ABORT = "abort"


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool = False


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    generated_text: str  # the completion only (never the prompt); stop string removed unless asked
    generated_tokens: int
    prompt: str  # the prompt text as the client gave it (before any `truncate`)
    prompt_tokens: int
    seed: int | None = None
    prefill: tuple[Token, ...] | None = None  # prompt tokens with logprobs (decoder_input_details)
    error: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, how many the prefix cache supplied (not computed again)
    stop_reason: str | int | None = None  # STOP_SEQUENCE: the stop string matched, or the stop token id
    # with SamplingParams.prompt_top_n set, per prompt token (None for the first): the rank of the token among
    # the model's choices at its position (1: the most likely) and the top-N tokens there, best first
    prefill_ranks: tuple[int | None, ...] | None = None
    prefill_top: tuple[tuple[Token, ...] | None, ...] | None = None


@dataclass(frozen=True)
class StepEvent:
    """One step of one sequence. `index` tells sequences of one request apart (n / best_of)."""

    token: Token | None
    top_tokens: tuple[Token, ...] | None = None
    finish: Finish | None = None
    index: int = 0
    # more events of this sequence follow at once (a speculative step's tokens, `stream_interval`): a streamed
    # response writes them together, with the first event that does not say so
    burst: bool = field(default=False, compare=False)
