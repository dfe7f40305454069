"""Engine events -> OpenAI-compatible bytes: chat completions and completions, whole or as SSE ending
in ``data: [DONE]``. Compact JSON, ``object`` first; ``id`` is ``chatcmpl-<32 hex>`` or ``cmpl-<32 hex>``,
new for every response (`completion_id`) and the same in every chunk of a stream.

Finish reasons are OpenAI's: ``"length"`` when ``max_tokens`` ended it, ``"stop"`` otherwise (EOS, a stop
string, a stop token id; ``"tool_calls"`` comes from tool_calls.py). Every choice carries vLLM's
``stop_reason`` after it: the stop string or stop token id that ended the sequence, else ``null``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.openai import scoring
from lmiserve.protocols.openai.errors import DONE, RENDERER
from lmiserve.protocols.openai.reasoning import Reasoning, Splitter
from lmiserve.protocols.textgen.sequences import GeneratedSequence, sequences
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, dumps
from lmiserve.server import sse

__all__ = [
    "DONE",
    "Answer",
    "ChatEncoder",
    "ChatStreamEncoder",
    "CompletionEncoder",
    "CompletionStreamEncoder",
    "Envelope",
    "chat_body",
    "chat_logprob",
    "completion_body",
    "completion_id",
    "finish_reason",
    "plain_answer",
    "stop_reason",
]


def finish_reason(finish: Finish) -> str:
    """OpenAI's finish reason: ``length`` or ``stop`` (TGI's ``eos_token`` and ``stop_sequence`` are both ``stop``)."""
    return "length" if finish.reason is FinishReason.LENGTH else "stop"


def stop_reason(finish: Finish | None) -> str | int | None:
    """vLLM's ``stop_reason``: the matched stop string or stop token id, else None (EOS, length, running)."""
    return finish.stop_reason if finish is not None else None


def completion_id(chat: bool) -> str:
    """A new unique id, as OpenAI spells them: ``chatcmpl-...`` for a chat completion, else ``cmpl-...``."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass
class Envelope:
    """The fields every OpenAI object starts with."""

    model: str
    system_fingerprint: str
    created: int = 0
    id: str = ""  # completion_id(...); one per response

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def head(self, obj: str) -> dict[str, Any]:
        return {
            "object": obj,
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


def usage(prompt: int, completion: int, cached: int, reasoning: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied;
    ``completion_tokens_details.reasoning_tokens`` with a reasoning parser (openai.reasoning)."""
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


def chat_logprob(token: Token, top: tuple[Token, ...] | None) -> dict:
    return {
        "token": token.text,
        "logprob": token.logprob,
        "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in top or ()],
    }


class _Whole:
    """Collects the tagged events of a whole answer; after `close`, the counts of the timing headers."""

    content_type = "application/json"
    streaming = False

    def __init__(self) -> None:
        self.events: list[tuple[int, StepEvent]] = []
        self.prompt_tokens = self.generated_tokens = self.characters = 0

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self.events.append((index, event))
        return b""

    def _require_finished(self, prompts: int) -> None:
        """`IncompleteGeneration` unless every prompt has a finished sequence."""
        if len({index for index, event in self.events if event.finish is not None}) < prompts:
            raise IncompleteGeneration("Incomplete generation")

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)


class _Stream:
    content_type = SSE_CONTENT_TYPE
    streaming = True

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)


# --- chat -------------------------------------------------------------------------------------------


# One choice's message and finish reason, from its sequence.
Answer = Callable[[GeneratedSequence], tuple[dict[str, Any], str]]


def plain_answer(seq: GeneratedSequence) -> tuple[dict[str, Any], str]:
    """The generated text as the assistant's content."""
    return {"role": "assistant", "content": seq.finish.generated_text}, finish_reason(seq.finish)


def chat_body(
    seqs: list[GeneratedSequence],
    env: Envelope,
    *,
    logprobs: bool,
    answer: Answer = plain_answer,
    prompt_logprobs: int | None = None,
    reasoning: Reasoning | None = None,
) -> bytes:
    """Non-streaming chat completion; `seqs` are the choices, best first. `prompt_logprobs`: vLLM's field
    after `usage` (openai.scoring); `reasoning`: the reasoning parser (the reasoning tokens in `usage`;
    `answer` already splits the message)."""
    choices = []
    for index, seq in enumerate(seqs):
        lp = {"content": [chat_logprob(t, top) for t, top in zip(seq.tokens, seq.top_tokens)]} if logprobs else None
        message, reason = answer(seq)
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": stop_reason(seq.finish),
            }
        )
    prompt, cached = seqs[0].finish.prompt_tokens, seqs[0].finish.cached_tokens
    completion = sum(s.finish.generated_tokens for s in seqs)
    thought = sum(reasoning.tokens(t.text for t in s.tokens) for s in seqs) if reasoning is not None else None
    body = {**env.head("chat.completion"), "choices": choices, "usage": usage(prompt, completion, cached, thought)}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = scoring.prompt_logprobs(seqs[0].finish, prompt_logprobs)
    return dumps(body)


class ChatEncoder(_Whole):
    """A whole chat completion (one prompt, its sequences as choices)."""

    def __init__(
        self,
        env: Envelope,
        prompt: str,
        *,
        logprobs: bool,
        answer: Answer = plain_answer,
        prompt_logprobs: int | None = None,
        reasoning: Reasoning | None = None,
    ):
        super().__init__()
        self.env, self.prompt, self.logprobs, self.answer = env, prompt, logprobs, answer
        self.prompt_logprobs, self.reasoning = prompt_logprobs, reasoning

    def close(self) -> bytes:
        self._require_finished(1)
        seqs = sequences(event for _, event in self.events)
        self.prompt_tokens = seqs[0].finish.prompt_tokens
        self.generated_tokens = sum(s.finish.generated_tokens for s in seqs)
        self.characters = len(self.prompt)
        return chat_body(
            seqs,
            self.env,
            logprobs=self.logprobs,
            answer=self.answer,
            prompt_logprobs=self.prompt_logprobs,
            reasoning=self.reasoning,
        )


class ChatStreamEncoder(_Stream):
    """One chunk per token (every delta has ``role``), an optional usage chunk, then [DONE]. With a
    `reasoning` parser the deltas carry the block's text as ``reasoning_content`` / ``reasoning``."""

    def __init__(self, env: Envelope, *, logprobs: bool, include_usage: bool, reasoning: Reasoning | None = None):
        self.env = env
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens = 0
        self.reasoning = reasoning
        self.splitters: dict[int, Splitter] = {}  # per choice, with a reasoning parser

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if event.token is None:
            return b""
        finish = event.finish
        lp = {"content": [chat_logprob(event.token, event.top_tokens)]} if self.logprobs else None
        delta: dict[str, Any] = {"role": "assistant", "content": event.token.text}
        if self.reasoning is not None:
            splitter = self.splitters.setdefault(event.index, self.reasoning.splitter())
            delta = {"role": "assistant", **self.reasoning.delta(splitter, event.token.text, finish is not None)}
        choice = {
            "index": event.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason(finish) if finish else None,
            "stop_reason": stop_reason(finish),
        }
        if finish is not None:
            self.prompt_tokens, self.cached_tokens = finish.prompt_tokens, finish.cached_tokens
            self.completion_tokens += finish.generated_tokens
        return sse.event(dumps({**self.env.head("chat.completion.chunk"), "choices": [choice], "usage": None}))

    def close(self) -> bytes:
        tail = b""
        if self.include_usage:
            thought = sum(s.tokens for s in self.splitters.values()) if self.reasoning is not None else None
            body = usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, thought)
            tail = sse.event(dumps({**self.env.head("chat.completion.chunk"), "choices": [], "usage": body}))
        return tail + DONE


# --- completions ------------------------------------------------------------------------------------


def _legacy_logprobs(tokens: list[Token], tops: list[tuple[Token, ...] | None], start: int, top_n: int) -> dict:
    """OpenAI's legacy logprobs: each token's ``top_logprobs`` holds itself and its `top_n` most likely
    (openai.scoring); the first prompt token of an echo has null logprobs."""
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += 0 if t.special else len(t.text)  # a special prompt token (BOS) is not in the text
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [scoring.top_dict(t, top, top_n) for t, top in zip(tokens, tops)],
        "text_offset": offsets,
    }


def completion_body(
    per_prompt: list[list[GeneratedSequence]],
    prompts: list[str],
    env: Envelope,
    *,
    logprobs: bool,
    echo: bool,
    top_n: int = 0,
    score_only: bool = False,
    prompt_logprobs: int | None = None,
) -> bytes:
    """Non-streaming completion: choice index = prompt index x n + sequence rank; usage summed.
    `score_only` (``max_tokens: 0`` with echo): the generated token is left out; `prompt_logprobs`:
    vLLM's per-choice field (openai.scoring)."""
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for p, seqs in enumerate(per_prompt):
        prompt_tokens += seqs[0].finish.prompt_tokens
        cached_tokens += seqs[0].finish.cached_tokens
        for rank, seq in enumerate(seqs):
            completion_tokens += 0 if score_only else seq.finish.generated_tokens
            prefix = prompts[p] if echo else ""
            generated = "" if score_only else seq.finish.generated_text
            lp = None
            if logprobs:
                tokens = [] if score_only else list(seq.tokens)
                tops: list[tuple[Token, ...] | None] = [] if score_only else list(seq.top_tokens)
                if echo and seq.finish.prefill:
                    pre, pre_tops = scoring.echoed_prompt(seq.finish)
                    lp = _legacy_logprobs(pre + tokens, pre_tops + tops, 0, top_n)
                else:
                    lp = _legacy_logprobs(tokens, tops, len(prefix), top_n)
            choice = {
                "index": p * len(seqs) + rank,
                "text": prefix + generated,
                "logprobs": lp,
                "finish_reason": "length" if score_only else finish_reason(seq.finish),
                "stop_reason": None if score_only else stop_reason(seq.finish),
            }
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = scoring.prompt_logprobs(seq.finish, prompt_logprobs)
            choices.append(choice)
    return dumps(
        {
            **env.head("text_completion"),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }
    )


class CompletionEncoder(_Whole):
    """A whole completion: the events are tagged with their prompt's index."""

    def __init__(
        self,
        env: Envelope,
        prompts: list[str],
        *,
        logprobs: bool,
        echo: bool,
        top_n: int = 0,
        score_only: bool = False,
        prompt_logprobs: int | None = None,
    ):
        super().__init__()
        self.env, self.prompts, self.logprobs, self.echo = env, prompts, logprobs, echo
        self.top_n, self.score_only, self.prompt_logprobs = top_n, score_only, prompt_logprobs

    def close(self) -> bytes:
        self._require_finished(len(self.prompts))
        per_prompt = [sequences(e for i, e in self.events if i == p) for p in range(len(self.prompts))]
        self.prompt_tokens = sum(seqs[0].finish.prompt_tokens for seqs in per_prompt)
        if not self.score_only:
            self.generated_tokens = sum(s.finish.generated_tokens for seqs in per_prompt for s in seqs)
        self.characters = sum(len(p) for p in self.prompts)
        return completion_body(
            per_prompt,
            self.prompts,
            self.env,
            logprobs=self.logprobs,
            echo=self.echo,
            top_n=self.top_n,
            score_only=self.score_only,
            prompt_logprobs=self.prompt_logprobs,
        )


class CompletionStreamEncoder(_Stream):
    """Per prompt and token a ``text_completion`` event (``finish_reason: null`` until the sequence's last
    event, which has the real finish reason; no ``usage`` key); with `include_usage`
    (``stream_options.include_usage``, as vLLM) a last event with empty ``choices`` and the usage of every
    prompt and choice together; then [DONE]."""

    def __init__(self, env: Envelope, *, logprobs: bool, n: int = 1, top_n: int = 0, include_usage: bool = False):
        self.env = env
        self.logprobs = logprobs
        self.n = n
        self.top_n = top_n
        self.include_usage = include_usage
        self.prompt_tokens: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, cached)
        self.completion_tokens = 0

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        head = self.env.head("text_completion")  # TGI's order here: choices before model
        return {
            "object": head["object"],
            "id": head["id"],
            "created": head["created"],
            "choices": choices,
            "model": head["model"],
            "system_fingerprint": head["system_fingerprint"],
        }

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if event.token is None:
            return b""
        finish = event.finish
        lp = _legacy_logprobs([event.token], [event.top_tokens], 0, self.top_n) if self.logprobs else None
        choice = {
            "index": index * self.n + event.index,
            "text": event.token.text,
            "logprobs": lp,
            "finish_reason": finish_reason(finish) if finish else None,
            "stop_reason": stop_reason(finish),
        }
        if finish is not None:
            self.prompt_tokens[index] = (finish.prompt_tokens, finish.cached_tokens)
            self.completion_tokens += finish.generated_tokens
        return sse.event(dumps(self._chunk([choice])))

    def close(self) -> bytes:
        if not self.include_usage:
            return DONE
        prompt = sum(tokens for tokens, _ in self.prompt_tokens.values())
        cached = sum(cached for _, cached in self.prompt_tokens.values())
        body = {**self._chunk([]), "usage": usage(prompt, self.completion_tokens, cached)}
        return sse.event(dumps(body)) + DONE
