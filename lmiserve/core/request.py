"""A generation request as the engine sees it, whatever protocol carried it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from lmiserve.core.grammar import Grammar
from lmiserve.core.media import Image
from lmiserve.core.request_context import current_request_id

_ids = itertools.count(1)


def _request_id() -> str:
    """The id of the HTTP request being served (so the engine's log lines name it), else a counter."""
    return current_request_id() or f"req-{next(_ids)}"


@dataclass(frozen=True)
class ThinkingBudget:
    """A bound on a reasoning block, whatever protocol asked for it (Anthropic's `thinking.budget_tokens`,
    OpenAI's `reasoning_effort`): once `tokens` tokens were generated inside the block, the engine forces
    `close` (the end marker, or what a model family writes to end its thinking), token by token, then the
    answer follows.

    The block: the output starts inside it (`inside`: the chat template opened it), else it opens when
    the output starts with one of `starts` (whitespace before it allowed); it ends with any of `ends`. The
    tokens counted are those generated inside the block, after the one completing the start marker (as
    the reasoning parser counts `reasoning_tokens`). `close_ids`: `close` as token ids, filled in by the
    engine when it tokenizes the request.
    """

    tokens: int
    close: str
    ends: tuple[str, ...]
    starts: tuple[str, ...] = ()
    inside: bool = True
    close_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters. Names and defaults are those of LMI's request parameters. Immutable: a
    protocol builds them once, with every field it sets; a variant is derived (`dataclasses.replace`)."""

    do_sample: bool = False
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    typical_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_new_tokens: int = 30
    min_new_tokens: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos_token: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits (OpenAI's logit_bias)
    bad_words: list[str] = field(default_factory=list)  # vLLM's: never generated (the engine tokenizes them)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # bad_words as token ids, derived by the engine
    truncate: int | None = None  # keep only the last N prompt tokens
    decoder_input_details: bool = False  # prompt-token logprobs
    # with decoder_input_details: also each prompt token's rank and the N most likely tokens at its position
    prompt_top_n: int | None = None
    top_n_tokens: int = 0
    n: int = 1  # sequences returned (best first)
    best_of: int = 1  # sequences generated (>= n)
    grammar: Grammar | None = None  # constrain the output (structured output, tool calls)
    thinking: ThinkingBudget | None = None  # bound the reasoning block (the engine forces its end)

    @property
    def greedy(self) -> bool:
        return not self.do_sample


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine runs, as a protocol's parse step builds it: complete (its adapter, grammar, top
    tokens and every other field given at construction) and immutable; the engine derives the variant it
    runs (`dataclasses.replace`)."""

    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=_request_id)
    # vLLM's meaning: the waiting queue admits lower values first (ties in arrival order); default 0
    priority: int = 0
    # vLLM's: the KV blocks of its prompt are shared (prefix cache) only with requests of the same salt
    cache_salt: str | None = None
    prompt_ids: list[int] | None = None  # the prompt as token ids, used as given (`prompt`: their text)
    # n > 1: False streams each sequence's events as they are generated, interleaved, indexed by sampling order
    # (OpenAI's `n`; only when n == best_of); True (TGI's and LMI's best_of) ranks them, whole, best first
    ranked: bool = True
    # the LoRA adapter that answers (its registered name; None: the base model)
    adapter: str | None = None
    # a vision-language model's images (lmiserve/core/media.py), decoded, in the order of the image
    # placeholders the prompt's chat template wrote; the engine gives them to the model's processor
    images: tuple[Image, ...] = ()
