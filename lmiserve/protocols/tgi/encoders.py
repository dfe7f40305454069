"""Core events -> TGI bytes (reference tgi-openai.md §4, §5, §9): /generate JSON, the native SSE stream,
error bodies. Compact JSON (serde spelling: no spaces, raw UTF-8), field order as TGI writes it.

Token texts: the engine gives a special token (EOS) the empty text of a completion decoded without
special tokens; TGI shows its literal text (``"</s>"``) with ``special: true``. `special_text` (the
tokenizer's id -> literal text, given by the HTTP layer) supplies it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lmiserve.core.events import Finish, StepEvent, Token

SpecialText = Callable[[int], str]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def error_body(message: str, kind: str) -> bytes:
    return dumps({"error": message, "error_type": kind})


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


@dataclass
class AnswerShape:
    """What the request asked for (from `adapters.tgi.TgiCall`)."""

    prompt: str
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    top_n_tokens: int
    sampling: bool
    input_length: int


def token_obj(token: Token, special_text: SpecialText | None = None) -> dict:
    text = token.text
    if token.special and special_text is not None and not text:
        text = special_text(token.id)
    return {"id": token.id, "text": text, "logprob": token.logprob, "special": token.special}


def _plain_token(token: Token) -> dict:
    return {"id": token.id, "text": token.text, "logprob": token.logprob, "special": token.special}


def _prefill(finish: Finish, shape: AnswerShape) -> list[dict]:
    if not shape.decoder_input_details or not finish.prefill:
        return []
    return [{"id": t.id, "text": t.text, "logprob": None if i == 0 else t.logprob} for i, t in enumerate(finish.prefill)]


@dataclass
class Sequence:
    """One generated sequence collected from its events."""

    tokens: list[Token]
    top_tokens: list[tuple[Token, ...]]
    finish: Finish

    @property
    def mean_logprob(self) -> float:
        lps = [t.logprob for t in self.tokens if t.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")


def sequences(events: Iterable[StepEvent]) -> list[Sequence]:
    """Group events by sequence index; the best (highest mean token logprob, §4.1) first."""
    by_index: dict[int, tuple[list, list]] = {}
    finishes: dict[int, Finish] = {}
    for event in events:
        tokens, tops = by_index.setdefault(event.index, ([], []))
        if event.token is not None:
            tokens.append(event.token)
            tops.append(event.top_tokens or ())
        if event.finish is not None:
            finishes[event.index] = event.finish
    seqs = [Sequence(by_index[i][0], by_index[i][1], finishes[i]) for i in sorted(finishes)]
    return sorted(seqs, key=lambda s: s.mean_logprob, reverse=True)


def _text(seq: Sequence, shape: AnswerShape) -> str:
    return (shape.prompt if shape.return_full_text else "") + seq.finish.generated_text


def _details(seq: Sequence, shape: AnswerShape, special_text: SpecialText | None, *, best_of: bool) -> dict:
    out: dict[str, Any] = {}
    if best_of:
        out["generated_text"] = _text(seq, shape)
    out["finish_reason"] = seq.finish.reason.value
    out["generated_tokens"] = seq.finish.generated_tokens
    out["seed"] = seq.finish.seed if shape.sampling else None
    out["prefill"] = _prefill(seq.finish, shape)
    out["tokens"] = [token_obj(t, special_text) for t in seq.tokens]
    return out


def generate_body(seqs: list[Sequence], shape: AnswerShape, special_text: SpecialText | None = None) -> dict:
    """The /generate response object (§4.1); `seqs` best first."""
    best = seqs[0]
    body: dict[str, Any] = {"generated_text": _text(best, shape)}
    if shape.details:
        details = _details(best, shape, special_text, best_of=False)
        if len(seqs) > 1:
            others = []
            for seq in seqs[1:]:
                item = _details(seq, shape, special_text, best_of=True)
                if shape.top_n_tokens:
                    item["top_tokens"] = [[_plain_token(t) for t in step] for step in seq.top_tokens]
                others.append(item)
            details["best_of_sequences"] = others
        if shape.top_n_tokens:
            details["top_tokens"] = [[_plain_token(t) for t in step] for step in best.top_tokens]
        body["details"] = details
    return body


class StreamFormatter:
    """The native SSE stream (§4.3): one event per token, 1-based `index`, final text and details last."""

    def __init__(self, shape: AnswerShape, special_text: SpecialText | None = None):
        self.shape = shape
        self.special_text = special_text
        self.count = 0
        self.finished = False

    def on_event(self, event: StepEvent) -> bytes:
        if event.token is None:
            return b""
        self.count += 1
        obj: dict[str, Any] = {"index": self.count, "token": token_obj(event.token, self.special_text)}
        if self.shape.top_n_tokens:
            obj["top_tokens"] = [_plain_token(t) for t in event.top_tokens or ()]
        finish = event.finish
        if finish is None:
            obj["generated_text"] = None
            obj["details"] = None
        else:
            self.finished = True
            obj["generated_text"] = (self.shape.prompt if self.shape.return_full_text else "") + finish.generated_text
            obj["details"] = (
                {
                    "finish_reason": finish.reason.value,
                    "generated_tokens": finish.generated_tokens,
                    "seed": finish.seed if self.shape.sampling else None,
                    "input_length": finish.prompt_tokens,
                }
                if self.shape.details
                else None
            )
        return sse_event(dumps(obj))

    def close(self) -> bytes:
        """Nothing after a final event; a stream that ended without one gets TGI's error event (§9.3)."""
        if self.finished:
            return b""
        return self.error_event("Incomplete generation stream", "incomplete_generation_stream")

    @staticmethod
    def error_event(message: str, kind: str) -> bytes:
        return sse_event(error_body(message, kind))
