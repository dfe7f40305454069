"""Engine events -> Anthropic Messages bytes: a whole message, or Anthropic's server-sent events.

A message's ``content`` is, in order: the ``thinking`` block (with a reasoning parser, when the model
thought something; ``signature`` empty), a ``text`` block when there is text, then a ``tool_use`` block per
complete call (``id`` ``toolu_<24 hex>``, ``input`` the arguments). ``stop_reason``: ``tool_use`` when
the answer is complete calls, ``max_tokens`` when ``max_tokens`` ended it, ``stop_sequence`` (with
``stop_sequence`` naming it, left out of the text) for a stop sequence, ``end_turn`` otherwise.
``usage.input_tokens`` counts the prompt tokens computed, ``cache_read_input_tokens`` those the prefix
cache supplied (their sum is the prompt's length, what count_tokens answers).

A stream is ``event: <type>`` / ``data: <json>`` events: ``message_start`` (empty content, null
``stop_reason``), then each block as ``content_block_start`` (empty), ``content_block_delta``
(``thinking_delta``, ``text_delta`` or, for a call, ``input_json_delta`` pieces that concatenate to its
``input``) and ``content_block_stop``, one ``ping`` after the first block's start (or before the end
when there is no block), then ``message_delta`` (``stop_reason``, ``stop_sequence``, the whole usage)
and ``message_stop``. Blocks open as their first text is known, so an empty answer has none. A call
cut by ``max_tokens`` was already streamed in part (its block ends, ``stop_reason`` ``max_tokens``); a
whole answer leaves it out. A failure after the start is an ``event: error``, the last event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, FinishReason, StepEvent
from lmiserve.protocols.anthropic.errors import RENDERER, event
from lmiserve.protocols.textgen.reasoning import Reasoning, Splitter
from lmiserve.protocols.textgen.sequences import sequences
from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content, Piece
from lmiserve.protocols.textgen.tools.parsers import CallReader
from lmiserve.protocols.textgen.tools.spec import ToolSpec
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, dumps


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: Finish, output: CallReader | None) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished answer."""
    if output is not None and output.calls and output.done:
        return "tool_use", None
    if finish.reason is FinishReason.LENGTH:
        return "max_tokens", None
    if finish.reason is FinishReason.STOP_SEQUENCE and isinstance(finish.stop_reason, str):
        return "stop_sequence", finish.stop_reason
    return "end_turn", None


def usage(finish: Finish, output_tokens: int | None = None) -> dict[str, int]:
    return {
        "input_tokens": finish.prompt_tokens - finish.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": finish.cached_tokens,
        "output_tokens": finish.generated_tokens if output_tokens is None else output_tokens,
    }


def head(msg_id: str, model: str) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


class MessageEncoder:
    """A whole message (the events of one sequence)."""

    content_type = "application/json"
    streaming = False

    def __init__(self, msg_id: str, model: str, *, tools: ToolSpec | None, reasoning: Reasoning | None):
        self.msg_id, self.model, self.tools, self.reasoning = msg_id, model, tools, reasoning
        self.events: list[StepEvent] = []
        self.prompt_tokens = self.generated_tokens = 0

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self.events.append(event)
        return b""

    def close(self) -> bytes:
        seqs = sequences(self.events)
        if not seqs:
            raise IncompleteGeneration("Incomplete generation")
        finish = seqs[0].finish
        self.prompt_tokens, self.generated_tokens = finish.prompt_tokens, finish.generated_tokens
        text: str | None = finish.generated_text
        content: list[dict[str, Any]] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.split(finish.generated_text)
            if thought:
                content.append(thinking_block(thought))
        output = None
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            output = self.tools.reader()
            output.feed(text or "")
            output.finish()
            text = output.content
            calls = [
                {"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": json.loads(c.arguments or "{}")}
                for c in output.calls
            ]
        if text:
            content.append({"type": "text", "text": text})
        content += calls
        reason, sequence = stop_reason(finish, output)
        body = {
            **head(self.msg_id, self.model),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(finish),
        }
        return dumps(body)

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)


class MessageStreamEncoder:
    """Anthropic's event stream of one sequence (see the module docstring)."""

    content_type = SSE_CONTENT_TYPE
    streaming = True

    def __init__(
        self,
        msg_id: str,
        model: str,
        input_tokens: int,
        *,
        tools: ToolSpec | None,
        reasoning: Reasoning | None,
    ):
        self.msg_id, self.model, self.input_tokens = msg_id, model, input_tokens
        self.output: CallReader | None = tools.reader() if tools is not None else None
        self.splitter: Splitter | None = reasoning.splitter() if reasoning is not None else None
        self.started = self.pinged = False
        self.index = -1  # of the open block, else of the last one
        self.open: tuple[str, int] | None = None  # the open block: its kind and, for a call, its index
        self.finish: Finish | None = None

    # --- blocks -------------------------------------------------------------------------------------

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return event("content_block_stop", dumps({"type": "content_block_stop", "index": self.index}))

    def _start(self, kind: str, block: dict[str, Any], call: int = -1) -> bytes:
        out = self._stop()
        self.index += 1
        self.open = (kind, call)
        body = {"type": "content_block_start", "index": self.index, "content_block": block}
        out += event("content_block_start", dumps(body))
        if not self.pinged:
            self.pinged = True
            out += event("ping", dumps({"type": "ping"}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", dumps({"type": "content_block_delta", "index": self.index, "delta": delta}))

    def _thinking(self, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self.open == ("thinking", -1) else self._start("thinking", thinking_block(""))
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b"" if self.open == ("text", -1) else self._start("text", {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def _pieces(self, pieces: list[Piece]) -> bytes:
        out = b""
        for piece in pieces:
            if isinstance(piece, Content):
                out += self._text(piece.text)
            elif isinstance(piece, CallStart):
                block = {"type": "tool_use", "id": tool_use_id(), "name": piece.name, "input": {}}
                out += self._start("tool_use", block, piece.index)
            elif isinstance(piece, Arguments) and piece.text and self.open == ("tool_use", piece.index):
                out += self._delta({"type": "input_json_delta", "partial_json": piece.text})
        return out

    # --- the encoder --------------------------------------------------------------------------------

    def _message_start(self) -> bytes:
        self.started = True
        message = {
            **head(self.msg_id, self.model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        return event("message_start", dumps({"type": "message_start", "message": message}))

    def on_event(self, index: int, step: StepEvent) -> bytes:
        out = b"" if self.started else self._message_start()
        text = step.token.text if step.token is not None else ""
        final = step.finish is not None
        thought, answer = "", text
        if self.splitter is not None:
            thought, answer = self.splitter.token(text) if step.token is not None else ("", "")
            if final:
                more_thought, more_answer = self.splitter.flush()
                thought, answer = thought + more_thought, answer + more_answer
        out += self._thinking(thought)
        if self.output is not None:
            pieces = self.output.feed(answer) if answer else []
            if final:
                pieces += self.output.finish()
            out += self._pieces(pieces)
        else:
            out += self._text(answer)
        if final:
            self.finish = step.finish
        return out

    def close(self) -> bytes:
        if self.finish is None:
            raise IncompleteGeneration("Incomplete generation")
        out = b"" if self.started else self._message_start()
        out += self._stop()
        if not self.pinged:
            self.pinged = True
            out += event("ping", dumps({"type": "ping"}))
        reason, sequence = stop_reason(self.finish, self.output)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self.finish),
        }
        return out + event("message_delta", dumps(delta)) + event("message_stop", dumps({"type": "message_stop"}))

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)
