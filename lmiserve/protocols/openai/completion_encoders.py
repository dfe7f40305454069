"""Engine events -> OpenAI (legacy) completions, whole or as SSE ending in ``data: [DONE]``, with the
legacy ``logprobs`` object (the shared envelope, usage and finish reasons: encoders.py)."""

from __future__ import annotations

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
from lmiserve.protocols.textgen.sequences import GeneratedSequence, sequences
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import sse

__all__ = ["CompletionEncoder", "CompletionStreamEncoder", "completion_body"]


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


class CompletionEncoder(WholeEncoder):
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


class CompletionStreamEncoder(StreamEncoder):
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
