"""Engine events -> OpenAI chat completions, whole or as SSE ending in ``data: [DONE]`` (the shared
envelope, usage and finish reasons: encoders.py; with tools: tool_calls.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmiserve.core.events import StepEvent, Token
from lmiserve.protocols.openai import scoring
from lmiserve.protocols.openai.encoders import (
    Envelope,
    StreamEncoder,
    WholeEncoder,
    finish_reason,
    stop_reason,
    usage,
)
from lmiserve.protocols.openai.errors import DONE
from lmiserve.protocols.openai.reasoning import Reasoning, Splitter
from lmiserve.protocols.textgen.sequences import GeneratedSequence, sequences
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import sse

__all__ = ["Answer", "ChatEncoder", "ChatStreamEncoder", "chat_body", "chat_logprob", "plain_answer"]


def chat_logprob(token: Token, top: tuple[Token, ...] | None) -> dict:
    return {
        "token": token.text,
        "logprob": token.logprob,
        "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in top or ()],
    }


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


class ChatEncoder(WholeEncoder):
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


class ChatStreamEncoder(StreamEncoder):
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
