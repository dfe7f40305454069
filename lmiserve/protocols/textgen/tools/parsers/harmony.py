"""``openai``: gpt-oss's harmony messages, read with their special tokens.

The answer is a sequence of messages, each a header, ``<|message|>``, a body and ``<|end|>``, ``<|call|>``
or ``<|return|>``; the first one's ``<|start|>assistant`` is in the prompt, the later ones begin with it::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

The header names the channel (``<|channel|>analysis``, ``commentary`` or ``final``) and, for a call, the
recipient (``to=functions.NAME``, before or after the channel). A message to ``functions.NAME`` is a call
whose arguments are the body (JSON; an empty body is ``{}``); the content is the bodies of ``final``
messages and of ``commentary`` messages to no one (preambles), joined by newlines; ``analysis`` is
reasoning (`harmony_reasoning`), never content, and messages to built-in tools (``browser.*``,
``python``) are dropped. Text before any header (a prompt that opened the final message itself) is
content. Header text is never content; while streaming, a header is read once whole, and a body holds
back what may still become a marker.

When the text is complete, a call whose body is not a JSON object is plain text (its whole message); a
last message without its end marker still counts (``<|call|>`` and ``<|return|>`` are the model's stop
tokens, which the text may not include).

The grammar writes ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
(after ``<|start|>assistant`` too, for a grammar that begins after an analysis message); several calls
repeat it after ``<|start|>assistant`` (``<|call|>`` is a stop token of gpt-oss, so the model usually
stops after the first).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.parsers.base import (
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    held_back,
    lark_grammar,
    lark_json,
    lark_one_of,
    repeat_calls,
    text_literal,
)
from lmiserve.protocols.textgen.tools.schema import arguments_schema

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)  # consumed with their message
_BREAKS = (START, CHANNEL)  # a new message: ends the one before without being part of it
_HEADER_STARTS = (START, CHANNEL, CONSTRAIN, "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_SPACE = " \t\r\n"
FUNCTIONS = "functions."


@dataclass
class _Message:
    start: int  # offset of its header (or body, without one)
    end: int  # offset after its end marker, or of the end of the text
    channel: str | None
    recipient: str | None
    body: str  # without a marker that may still be coming when not final
    closed: bool  # its end marker was read


class HarmonyParser(ToolParser):
    name = "openai"
    # gpt-oss's chat template writes channels; these two are in its source (its calls are written
    # "<|channel|>commentary " + content type, never with <|constrain|>)
    template_markers: ClassVar[tuple[str, ...]] = ("<|channel|>commentary", "<|channel|>final<|message|>")
    reads_special_tokens = True
    reads_every_answer = True

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        parts: list[str] = []
        calls: list[PartialCall] = []
        for message in _messages(text, final):
            if message.recipient is None:
                if message.channel != "analysis" and message.body:
                    parts.append(message.body)
                continue
            if not message.recipient.startswith(FUNCTIONS) or message.recipient == FUNCTIONS:
                continue  # a built-in tool's call
            call = PartialCall(message.recipient[len(FUNCTIONS) :], message.body.strip(_SPACE))
            if message.closed or final:
                arguments = call.arguments or "{}"
                call.complete = _is_object(arguments)
                if call.complete:
                    call.arguments = arguments
                elif final:
                    parts.append(text[message.start : message.end])  # malformed: plain text
                    continue
            calls.append(call)
        return Parsed("\n".join(parts), calls)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        functions = spec.functions[:1] if spec.mode == "named" else spec.functions
        rules: dict[str, str] = {}
        for i, function in enumerate(functions):
            rules[f"call_{i}"] = " ".join(
                [
                    lit(CHANNEL),
                    text_literal(f"commentary to={FUNCTIONS}{function.name} "),
                    lit(CONSTRAIN),
                    text_literal("json"),
                    lit(MESSAGE),
                    lark_json(arguments_schema(function.parameters)),
                    lit(CALL),
                ]
            )
        start = f"{lit(START)} {text_literal('assistant')}"
        calls = repeat_calls(lark_one_of(list(rules)), start, spec)
        rules["WS"] = r"/[ \t\r\n]+/"
        # the first call's <|start|>assistant is in the prompt, or written when the grammar begins after
        # an analysis message
        return lark_grammar(f"WS? ({start})? {calls}", rules)


def harmony_reasoning(text: str) -> str:
    """The analysis-channel text of a whole answer (its messages to no one), joined by newlines."""
    return "\n".join(
        m.body for m in _messages(text, final=True) if m.channel == "analysis" and m.recipient is None and m.body
    )


def _messages(text: str, final: bool) -> list[_Message]:
    """The messages of `text` whose header was read (all of it), in order."""
    messages: list[_Message] = []
    pos, n = 0, len(text)
    while pos < n:
        start = pos
        while start < n and text[start] in _SPACE:
            start += 1
        rest = text[start:]
        if not rest:
            break
        if rest.startswith(_HEADER_STARTS):
            marker = text.find(MESSAGE, start)
            if marker < 0:
                break  # the header goes on (or was cut off: never content)
            header = text[start:marker]
            channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
            body_start = marker + len(MESSAGE)
            message = _Message(
                start, n, channel.group(1) if channel else None, recipient.group(1) if recipient else None, "", False
            )
        elif not final and any(h.startswith(rest) for h in _HEADER_STARTS):
            break  # may still become a header
        else:  # no header: the final answer's text
            body_start = start = pos
            message = _Message(start, n, "final", None, "", False)
        pos = _body(text, body_start, message, final)
        messages.append(message)
    return messages


def _body(text: str, i: int, message: _Message, final: bool) -> int:
    """Read the body from `i` into `message`; the offset where the next message starts."""
    ends = [(at, m) for m in (*_ENDS, *_BREAKS) if (at := text.find(m, i)) >= 0]
    if not ends:
        body = text[i:]
        if not final:
            body = body[: len(body) - held_back(body, (*_ENDS, *_BREAKS))]
        message.body = body
        return len(text)
    at, marker = min(ends)
    message.body = text[i:at]
    if marker in _ENDS:
        message.closed = True
        message.end = at + len(marker)
        return message.end
    message.closed = True  # the next message began without an end marker
    message.end = at
    return at


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
