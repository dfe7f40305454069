"""Engine events -> TGI bytes: the /generate JSON (a one-element list on the compat route) and the
native SSE stream. Compact JSON (serde spelling: no spaces, raw UTF-8), fields in TGI's order.

Token texts: the engine gives a special token (EOS) the empty text of a completion decoded without
special tokens; TGI shows its literal text (``"</s>"``) with ``special: true``. `special_text` (the
tokenizer's id -> literal text) supplies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, StepEvent, Token
from lmiserve.protocols.textgen.sequences import GeneratedSequence, sequences
from lmiserve.protocols.textgen.validation import TextGenCall
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, dumps
from lmiserve.protocols.tgi.errors import RENDERER
from lmiserve.server import sse

__all__ = ["AnswerShape", "GenerateEncoder", "StreamEncoder", "dumps", "generate_body", "sequences", "token_obj"]

SpecialText = Callable[[int], str]


@dataclass
class AnswerShape:
    """What the request asked the answer to show."""

    prompt: str
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    top_n_tokens: int
    sampling: bool
    input_length: int

    @classmethod
    def of(cls, prompt: str, call: TextGenCall) -> AnswerShape:
        return cls(
            prompt,
            call.details,
            call.decoder_input_details,
            call.return_full_text,
            call.top_n_tokens,
            call.sampling,
            call.input_length,
        )


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
    return [
        {"id": t.id, "text": t.text, "logprob": None if i == 0 else t.logprob} for i, t in enumerate(finish.prefill)
    ]


def _text(seq: GeneratedSequence, shape: AnswerShape) -> str:
    return (shape.prompt if shape.return_full_text else "") + seq.finish.generated_text


def _details(seq: GeneratedSequence, shape: AnswerShape, special_text: SpecialText | None, *, best_of: bool) -> dict:
    out: dict[str, Any] = {}
    if best_of:
        out["generated_text"] = _text(seq, shape)
    out["finish_reason"] = seq.finish.reason.value
    out["generated_tokens"] = seq.finish.generated_tokens
    out["seed"] = seq.finish.seed if shape.sampling else None
    out["prefill"] = _prefill(seq.finish, shape)
    out["tokens"] = [token_obj(t, special_text) for t in seq.tokens]
    return out


def generate_body(seqs: list[GeneratedSequence], shape: AnswerShape, special_text: SpecialText | None = None) -> dict:
    """The /generate response object; `seqs` best first (the others are ``best_of_sequences``)."""
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


class GenerateEncoder:
    """The whole /generate answer (``[answer]`` on the compat route). After `close`, `best` is the
    best sequence (its counts go into the timing headers)."""

    content_type = "application/json"
    streaming = False

    def __init__(self, shape: AnswerShape, special_text: SpecialText | None = None, *, compat: bool = False):
        self.shape = shape
        self.special_text = special_text
        self.compat = compat
        self.events: list[StepEvent] = []
        self.best: GeneratedSequence | None = None

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self.events.append(event)
        return b""

    def close(self) -> bytes:
        seqs = sequences(self.events)
        if not seqs:
            raise IncompleteGeneration("Incomplete generation")
        self.best = seqs[0]
        body = generate_body(seqs, self.shape, self.special_text)
        return dumps([body] if self.compat else body)

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)


class StreamEncoder:
    """The native SSE stream: one event per token with a 1-based `index`; the last one carries the
    final text (and the details when asked). No ``[DONE]``."""

    content_type = SSE_CONTENT_TYPE
    streaming = True

    def __init__(self, shape: AnswerShape, special_text: SpecialText | None = None):
        self.shape = shape
        self.special_text = special_text
        self.count = 0
        self.finished = False

    def on_event(self, index: int, event: StepEvent) -> bytes:
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
        return sse.event(dumps(obj))

    def close(self) -> bytes:
        """Nothing after a final event; `IncompleteGeneration` when the stream ended without one."""
        if self.finished:
            return b""
        raise IncompleteGeneration("Incomplete generation stream")

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)
