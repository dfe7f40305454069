"""Chat answers generated under tools (see `lmiserve.protocols.textgen.tools`): the generated JSON read
back as OpenAI's ``tool_calls``.

Whole answer: calls give ``message = {"role": "assistant", "content": null, "tool_calls": [{"id":
"call_...", "type": "function", "function": {"name", "arguments": "<JSON text>"}}]}`` and
``finish_reason: "tool_calls"``; a plain answer (``{"content": ...}``) gives its text as ``content``
and the engine's finish reason. Only complete calls are listed: an answer cut by ``max_tokens`` (or a
stop sequence) keeps the calls finished before the cut, ``content`` null (or the plain answer's text
so far) and the engine's finish reason (``length``).

Stream: a chunk per token that made something known; the first chunk of a choice has ``"role":
"assistant"``, the others not (OpenAI's client concatenates every string it receives). A call starts
with ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` and its arguments
follow as ``{"index", "function": {"arguments": "<piece>"}}`` as they are generated (the pieces
concatenate to the arguments string; OpenAI's and TGI's clients accumulate them by ``index``); a plain
answer streams as ``content``. Tokens that make nothing known (``{"name": "``) send no chunk unless
logprobs were asked for. The last chunk has the finish reason: ``tool_calls`` when the answer was
complete calls. A call cut by ``max_tokens`` has already been streamed in part: ``finish_reason:
"length"`` says so.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from lmiserve.core.errors import LmiServeError
from lmiserve.core.events import Finish, StepEvent
from lmiserve.protocols.openai.chat_encoders import Answer, chat_logprob
from lmiserve.protocols.openai.encoders import Envelope, finish_reason, stop_reason, usage
from lmiserve.protocols.openai.errors import DONE, RENDERER
from lmiserve.protocols.openai.reasoning import Reasoning, Splitter
from lmiserve.protocols.textgen.sequences import GeneratedSequence
from lmiserve.protocols.textgen.tools.output import Arguments, CallStart, Content, Piece, ToolOutput
from lmiserve.protocols.textgen.tools.parsers import CallReader
from lmiserve.protocols.textgen.tools.spec import ToolSpec
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE, dumps
from lmiserve.server import sse

CallIds = Callable[[], str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _reason(output: CallReader, finish: Finish) -> str:
    return "tool_calls" if output.calls and output.done else finish_reason(finish)


def _reader(tools: ToolSpec | None) -> CallReader:
    return tools.reader() if tools is not None else ToolOutput()


def _call_ids(tools: ToolSpec | None, call_ids: CallIds | None) -> CallIds:
    """Ids as given (tests), else as the model's format makes them (Mistral's templates want 9 characters)."""
    if call_ids is not None:
        return call_ids
    return tools.format.call_id if tools is not None else new_call_id


def tool_answer(tools: ToolSpec | None = None, call_ids: CallIds | None = None) -> Answer:
    """The `Answer` of a tool-calling chat completion, read in `tools`' call format."""
    ids = _call_ids(tools, call_ids)

    def answer(seq: GeneratedSequence) -> tuple[dict[str, Any], str]:
        output = _reader(tools)
        output.feed(seq.finish.generated_text)
        output.finish()
        message: dict[str, Any] = {"role": "assistant", "content": output.content}
        if output.calls:
            message["tool_calls"] = [
                {"id": ids(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in output.calls
            ]
        return message, _reason(output, seq.finish)

    return answer


class ToolChatStreamEncoder:
    """The SSE stream of a tool-calling chat completion (see the module docstring)."""

    content_type = SSE_CONTENT_TYPE
    streaming = True

    def __init__(
        self,
        env: Envelope,
        *,
        logprobs: bool,
        include_usage: bool,
        call_ids: CallIds | None = None,
        reasoning: Reasoning | None = None,
        tools: ToolSpec | None = None,
    ):
        self.env = env
        self.reasoning = reasoning  # the reasoning block streams as `reasoning_content`; the calls follow it
        self.splitters: dict[int, Splitter] = {}
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.tools = tools
        self.call_ids = _call_ids(tools, call_ids)
        # the format's markers are special tokens (`[TOOL_CALLS]`): their text is read too
        self.special = tools is not None and tools.format.reads_special_tokens
        self.outputs: dict[int, CallReader] = {}  # per choice
        self.started: set[int] = set()  # choices whose first chunk (with the role) was sent
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens = 0

    def on_event(self, index: int, event: StepEvent) -> bytes:
        if event.token is None and event.finish is None:
            return b""
        output = self.outputs.get(event.index)
        if output is None:
            output = self.outputs[event.index] = _reader(self.tools)
        pieces: list[Piece] = []
        thought = ""
        finish = event.finish
        token_text = event.token.text if event.token is not None and (self.special or not event.token.special) else ""
        if self.reasoning is not None:
            splitter = self.splitters.setdefault(event.index, self.reasoning.splitter())
            thought, answer = splitter.token(token_text) if event.token is not None else ("", "")
            if finish is not None:
                more_thought, more_answer = splitter.flush()
                thought, answer = thought + more_thought, answer + more_answer
            if answer:
                pieces += output.feed(answer)
        elif token_text:
            pieces += output.feed(token_text)
        if finish is not None:
            pieces += output.finish()
            self.prompt_tokens, self.cached_tokens = finish.prompt_tokens, finish.cached_tokens
            self.completion_tokens += finish.generated_tokens
        delta = self._delta(pieces)
        if thought:
            delta = {"reasoning_content": thought, "reasoning": thought, **delta}
        if not delta and finish is None and not (self.logprobs and event.token is not None):
            return b""  # nothing new to say
        if event.index not in self.started:
            self.started.add(event.index)
            delta = {"role": "assistant", **delta}
        lp = None
        if self.logprobs and event.token is not None:
            lp = {"content": [chat_logprob(event.token, event.top_tokens)]}
        body = {
            "index": event.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": _reason(output, finish) if finish else None,
            "stop_reason": stop_reason(finish),
        }
        return sse.event(dumps({**self.env.head("chat.completion.chunk"), "choices": [body], "usage": None}))

    def _delta(self, pieces: list[Piece]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        content = "".join(p.text for p in pieces if isinstance(p, Content))
        if content:
            delta["content"] = content
        calls: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                function = {"name": piece.name, "arguments": ""}
                calls.append({"index": piece.index, "id": self.call_ids(), "type": "function", "function": function})
            elif isinstance(piece, Arguments):
                if calls and calls[-1]["index"] == piece.index:
                    calls[-1]["function"]["arguments"] += piece.text
                else:
                    calls.append({"index": piece.index, "function": {"arguments": piece.text}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    def close(self) -> bytes:
        tail = b""
        if self.include_usage:
            thought = sum(s.tokens for s in self.splitters.values()) if self.reasoning is not None else None
            body = usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, thought)
            tail = sse.event(dumps({**self.env.head("chat.completion.chunk"), "choices": [], "usage": body}))
        return tail + DONE

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)
