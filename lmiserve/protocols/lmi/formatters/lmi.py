"""LMI text-generation formatters: ``json``, ``jsonlines``, ``sse`` and their TGI variants.

Byte rules: `dumps` spacing, keys in LMI's order (see docs/protocols/lmi.md), absent optional keys
omitted (``log_prob`` may be null in ``prefill``), no trailing newline on the non-streaming body,
``object + "\\n"`` per jsonlines token, ``"data: " + object + "\\n\\n"`` per SSE event and no
``[DONE]``. A step without a token sends nothing, so no empty line/event is possible.

Decisions where LMI leaves room:
- ``generated_text`` is `Finish.generated_text` (equal to the concatenated token texts), with the
  prompt (`FormatOptions.prompt`, else `Finish.prompt`) prepended under ``return_full_text``;
  ``generated_tokens`` is `Finish.generated_tokens`.
- Streaming formats follow sequence 0 only (n/best_of are non-streaming features in LMI).
- A final event without a token (abort, or an error finish passed through) still produces the
  last record with ``generated_text``/``details``, just without the ``token`` key.
- In the best_of shape each sequence gets ``prefill``/``top_tokens`` before ``generated_text``
  when requested, like LMI's implementation; ``prefill`` is the request's (sequence 0's).
- Error finishes are intercepted by the response pipeline (424 before the first byte, the in-band
  error of protocols/lmi/errors.py after it). If one reaches a formatter it is rendered as LMI's
  formatter layer does, with ``finish_reason: error``
  (``details`` is ``{"finish_reason": "error"}`` when details are off). LMI's non-streaming
  ``{"generated_text": null, "error": ..., "code": 400}`` shape is not reproduced: LMI replaces
  it by the 424 body anyway.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.protocols.lmi.errors import RENDERER
from lmiserve.protocols.lmi.formatters.base import (
    FormatOptions,
    Formatter,
    dumps,
    register,
)
from lmiserve.server import sse

Json = dict[str, Any]


class _Sequence:
    """What the non-streaming formatter keeps of one sequence."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []
        self.top_tokens: list[tuple[Token, ...]] = []
        self.finish: Finish | None = None

    def add(self, event: StepEvent) -> None:
        if event.token is not None:
            self.tokens.append(event.token)
        if event.top_tokens is not None:
            self.top_tokens.append(event.top_tokens)
        if event.finish is not None:
            self.finish = event.finish


class LmiFormatter(Formatter):
    """Rendering shared by the LMI formats; `tgi` switches token keys and details default."""

    tgi: ClassVar[bool] = False

    def __init__(self, options: FormatOptions):
        super().__init__(options)
        self.details = self.tgi if options.details is None else options.details

    # --- pieces --------------------------------------------------------------------------------

    def token_dict(self, token: Token) -> Json:
        if self.tgi:
            out: Json = {"id": token.id, "text": token.text, "logprob": token.logprob}
            if token.special:
                out["special"] = True
        else:
            out = {"id": token.id, "text": token.text, "log_prob": token.logprob}
            if token.special:
                out["special_token"] = True
        return out

    def token_list(self, tokens: Iterable[Token]) -> list[Json]:
        return [self.token_dict(t) for t in tokens]

    def prompt(self, finish: Finish) -> str:
        return self.options.prompt or finish.prompt

    def generated_text(self, finish: Finish) -> str:
        if self.options.return_full_text:
            return self.prompt(finish) + finish.generated_text
        return finish.generated_text

    def extras(self, top_tokens: Sequence[Sequence[Token]], prefill: Sequence[Token] | None) -> Json:
        """``prefill`` and ``top_tokens`` when the request asked for them."""
        out: Json = {}
        if self.options.decoder_input_details:
            out["prefill"] = self.token_list(prefill or ())
        if self.options.top_n_tokens > 0:
            out["top_tokens"] = [self.token_list(step) for step in top_tokens]
        return out

    def details_dict(
        self, finish: Finish, top_tokens: Sequence[Sequence[Token]], tokens: list[Token] | None
    ) -> Json | None:
        """``details``; `tokens` None leaves out the ``tokens`` list (streaming)."""
        if not self.details:
            if finish.reason is FinishReason.ERROR:
                return {"finish_reason": finish.reason.value}
            return None
        out: Json = {
            "finish_reason": finish.reason.value,
            "generated_tokens": finish.generated_tokens,
            "inputs": self.prompt(finish),
        }
        if tokens is not None:
            out["tokens"] = self.token_list(tokens)
        out.update(self.extras(top_tokens, finish.prefill))
        return out


# --- non-streaming -----------------------------------------------------------------------------


@register("json")
class JsonFormatter(LmiFormatter):
    """One body at the end; the best_of/n shape when several sequences."""

    content_type = "application/json"
    streaming = False

    def __init__(self, options: FormatOptions):
        super().__init__(options)
        self._seqs: dict[int, _Sequence] = {}

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self._seqs.setdefault(event.index, _Sequence()).add(event)
        return b""

    def close(self) -> bytes:
        unfinished = [i for i, s in self._seqs.items() if s.finish is None]
        if 0 not in self._seqs or unfinished:
            raise IncompleteGeneration(f"events ended before every sequence finished: {unfinished or [0]}")
        o = self.options
        body = self._best_of_body() if o.n > 1 or o.best_of > 1 or len(self._seqs) > 1 else self._body()
        return dumps([body] if self.tgi else body).encode()

    def _body(self) -> Json:
        best = self._seqs[0]
        assert best.finish is not None
        body: Json = {"generated_text": self.generated_text(best.finish)}
        details = self.details_dict(best.finish, best.top_tokens, best.tokens)
        if details:
            body["details"] = details
        return body

    def _best_of_body(self) -> Json:
        best = self._seqs[0]
        assert best.finish is not None
        prefill = best.finish.prefill
        details: Json = {"inputs": self.prompt(best.finish), **self._sequence_details(best, prefill)}
        others = []
        for index in sorted(self._seqs):
            if index != 0:
                seq = self._seqs[index]
                assert seq.finish is not None
                other = self._sequence_details(seq, prefill)
                other["generated_text"] = self.generated_text(seq.finish)
                others.append(other)
        if others:
            details["best_of_sequences"] = others
        return {"generated_text": self.generated_text(best.finish), "details": details}

    def _sequence_details(self, seq: _Sequence, prefill: Sequence[Token] | None) -> Json:
        assert seq.finish is not None
        return {
            "finish_reason": seq.finish.reason.value,
            "generated_tokens": seq.finish.generated_tokens,
            "tokens": self.token_list(seq.tokens),
            **self.extras(seq.top_tokens, prefill),
        }


# --- streaming ---------------------------------------------------------------------------------


class _StreamingFormatter(LmiFormatter):
    """One record per token; the last one adds ``generated_text`` and ``details``."""

    streaming = True

    def __init__(self, options: FormatOptions):
        super().__init__(options)
        self._top_tokens: list[tuple[Token, ...]] = []

    @abstractmethod
    def frame(self, record: Json) -> bytes:
        """One record on the wire."""

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if event.index != 0:
            return b""
        if event.top_tokens is not None:
            self._top_tokens.append(event.top_tokens)
        record: Json = {}
        if event.token is not None:
            record["token"] = self.token_dict(event.token)
        if event.finish is not None:
            record["generated_text"] = self.generated_text(event.finish)
            details = self.details_dict(event.finish, self._top_tokens, None)
            if details:
                record["details"] = details
        return self.frame(record) if record else b""

    def close(self) -> bytes:
        return b""


@register("jsonlines")
class JsonlinesFormatter(_StreamingFormatter):
    content_type = "application/jsonlines"

    def frame(self, record: Json) -> bytes:
        return (dumps(record) + "\n").encode()

    def error(self, exc: LmiServeError) -> bytes:
        """The in-band error as a last complete line (LMI sends it without the newline; with it,
        line-splitting clients parse a complete last record)."""
        return RENDERER.in_band(exc) + b"\n"


@register("sse")
class SseFormatter(_StreamingFormatter):
    content_type = "text/event-stream"

    def frame(self, record: Json) -> bytes:
        return sse.event(dumps(record).encode())

    def error(self, exc: LmiServeError) -> bytes:
        """The in-band error as a ``data:`` event (LMI sends the raw body, which SSE clients such as
        huggingface_hub silently skip; as an event they raise)."""
        return sse.event(RENDERER.in_band(exc))


# --- TGI variants: logprob/special keys, details by default, array-wrapped json ---------


@register("tgi_json")
class TgiJsonFormatter(JsonFormatter):
    tgi = True


@register("tgi_jsonlines")
class TgiJsonlinesFormatter(JsonlinesFormatter):
    tgi = True


@register("tgi_sse")
class TgiSseFormatter(SseFormatter):
    tgi = True
