"""``deepseek_v3``: DeepSeek V3, R1-0528 and V3.1's calls, between their special tokens.

V3 and R1-0528 write ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
{...}\\n```<｜tool▁call▁end｜>`` (more calls, optionally after a newline) ``<｜tool▁calls▁end｜>``; V3.1 writes
each call as ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``. The markers use U+FF5C
(``｜``) and U+2581 (``▁``). Text before ``<｜tool▁calls▁begin｜>`` is content, and so is text after
``<｜tool▁calls▁end｜>``.

A call's name is known at the newline after it (V3) or at ``<｜tool▁sep｜>`` (V3.1); its arguments are
the JSON text between the fence (V3) or the separator (V3.1) and ``<｜tool▁call▁end｜>``, streamed as it
grows. When the text is complete, a call that did not close or whose arguments are not a JSON object
is plain text from its ``<｜tool▁call▁begin｜>`` on (from ``<｜tool▁calls▁begin｜>`` when no call came
before it). The grammar writes the V3 form.
"""  # noqa: RUF002

from __future__ import annotations

import json
import re
from collections.abc import Sequence
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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"  # noqa: RUF001
CALLS_END = "<｜tool▁calls▁end｜>"  # noqa: RUF001
CALL_BEGIN = "<｜tool▁call▁begin｜>"  # noqa: RUF001
CALL_END = "<｜tool▁call▁end｜>"  # noqa: RUF001
SEP = "<｜tool▁sep｜>"  # noqa: RUF001
_SPACE = " \t\r\n"
_FENCE = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"`{0,3}|```(?:j|js|jso|json)?[ \t]*")  # the fence so far
_FENCE_TEXT = "```json\n"
_TRAILING = _SPACE + "`"  # after V3's arguments: the closing fence

# outcomes of reading the calls and one call
_OPEN, _CLOSED, _ERROR = "open", "closed", "error"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    # DeepSeek V3's (and R1's, V3.1's) chat template writes an assistant's calls after this token
    template_markers: ClassVar[tuple[str, ...]] = (CALLS_BEGIN,)
    reads_special_tokens = True

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            return Parsed(text if final else text[: len(text) - held_back(text, (CALLS_BEGIN,))])
        before = text[:begin]
        calls, state, at = _read_calls(text, begin + len(CALLS_BEGIN))
        if state == _CLOSED:
            return Parsed(before + text[at:], calls)
        if not final:
            return Parsed(before, calls)
        good = [c for c in calls if c.complete]
        if not good:
            return Parsed(text)
        return Parsed(before + text[at:], good)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        functions = spec.functions[:1] if spec.mode == "named" else spec.functions
        rules: dict[str, str] = {}
        names = []
        for i, function in enumerate(functions):
            name = f"call_{i}"
            rules[name] = " ".join(
                [
                    lit(CALL_BEGIN),
                    text_literal("function"),
                    lit(SEP),
                    text_literal(f"{function.name}\n{_FENCE_TEXT}"),
                    lark_json(arguments_schema(function.parameters)),
                    text_literal("\n```"),
                    lit(CALL_END),
                ]
            )
            names.append(name)
        calls = repeat_calls(lark_one_of(names), '"\\n"?', spec)
        rules["WS"] = r"/[ \t\r\n]+/"
        return lark_grammar(f"WS? {lit(CALLS_BEGIN)} {calls} {lit(CALLS_END)}", rules)


def _read_calls(text: str, i: int) -> tuple[list[PartialCall], str, int]:
    """The calls after ``<｜tool▁calls▁begin｜>`` (ending before `i`): (calls, state, offset) with the
    offset after ``<｜tool▁calls▁end｜>`` when closed, else where the call that did not close begins
    (at ``<｜tool▁calls▁begin｜>`` for the first)."""  # noqa: RUF002
    calls: list[PartialCall] = []
    start = i - len(CALLS_BEGIN)
    while True:
        j = _skip_space(text, i)
        if text.startswith(CALLS_END, j):
            return calls, _CLOSED, j + len(CALLS_END)
        if not text.startswith(CALL_BEGIN, j):
            rest = text[j:]
            state = _OPEN if CALLS_END.startswith(rest) or CALL_BEGIN.startswith(rest) else _ERROR
            return calls, state, i if calls else start
        call = PartialCall(None)
        calls.append(call)
        state, end = _read_call(text, j + len(CALL_BEGIN), call)
        if state != _CLOSED:
            return calls, state, j if len(calls) > 1 else start
        i = end


def _read_call(text: str, i: int, call: PartialCall) -> tuple[str, int]:
    """One call after its ``<｜tool▁call▁begin｜>``, into `call`: (state, offset after its end)."""  # noqa: RUF002
    sep = text.find(SEP, i)
    if sep < 0:
        return _OPEN, len(text)
    kind = text[i:sep].strip(_SPACE)
    after = sep + len(SEP)
    rest = text[after:].lstrip(_SPACE)
    if kind == "function" and not rest:
        return _OPEN, len(text)  # V3's name or V3.1's arguments of a tool named "function"
    if kind == "function" and not rest.startswith("{"):
        newline = text.find("\n", after)
        if newline < 0:
            return _OPEN, len(text)
        name = text[after:newline].strip(_SPACE)
        if not name:
            return _ERROR, newline
        call.name = name
        fence = _FENCE.match(text, newline + 1)
        if fence is None:
            return (_OPEN if _FENCE_START.fullmatch(text, newline + 1) else _ERROR), len(text)
        return _arguments(text, fence.end(), call)
    if not kind or any(c in kind for c in _SPACE + "<>{"):
        return _ERROR, sep
    call.name = kind
    return _arguments(text, after, call)


def _arguments(text: str, i: int, call: PartialCall) -> tuple[str, int]:
    """The arguments from `i` to ``<｜tool▁call▁end｜>`` (without V3's closing fence)."""  # noqa: RUF002
    end = text.find(CALL_END, i)
    if end < 0:
        shown = text[i:]
        shown = shown[: len(shown) - held_back(shown, (CALL_END,))]
        call.arguments = shown.rstrip(_TRAILING).lstrip(_SPACE)
        return _OPEN, len(text)
    call.arguments = text[i:end].rstrip(_TRAILING).lstrip(_SPACE)
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return _ERROR, end
    if not isinstance(value, dict):
        return _ERROR, end
    call.complete = True
    return _CLOSED, end + len(CALL_END)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i
