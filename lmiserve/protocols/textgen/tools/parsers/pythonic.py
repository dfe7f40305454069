"""``pythonic`` and ``llama4_pythonic``: calls written as a Python list of calls (Llama 3.2, Llama 4).

The answer, after leading whitespace, is ``[get_weather(city="Paris", unit="celsius"), get_time()]``;
``llama4_pythonic`` also reads it between Llama 4's ``<|python_start|>`` and ``<|python_end|>``. Keyword
arguments are Python literals (strings, numbers, ``True``/``False``/``None``, lists, tuples, dicts; JSON's
``true``/``false``/``null`` are read too) and become the JSON arguments. An answer that does not start with
``[`` is plain text, and so is a list that is not calls with literal keyword arguments (positional
arguments, expressions, an empty list); text after the closed list is content.

While streaming, a call starts at ``name(``, and its arguments grow one keyword argument at a time as
each one's value completes (``{"city": "Paris"``, then ``, "unit": "celsius"``, then ``}`` at its ``)``).

The grammar (`pythonic_grammar`) writes ``[name(key=value, ...), ...]``: the declared properties in the
schema's order, the required ones always.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.parsers.base import (
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    arguments_text,
    text_literal,
)
from lmiserve.protocols.textgen.tools.parsers.pythonic_grammar import KEY, pythonic_grammar

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")  # a function name (OpenAI's names may hold '-')
_SPACE = " \t\r\n"
_JSON_NAMES = {"true": True, "false": False, "null": None}
# a string's body up to its closing quote (or a newline, or the end of the text), by its opening quote
_STRING_BODY = {
    "'": re.compile(r"(?:[^'\\\n]|\\[\s\S])*"),
    '"': re.compile(r'(?:[^"\\\n]|\\[\s\S])*'),
    "'''": re.compile(r"(?:[^'\\]|\\[\s\S]|'(?!''))*"),
    '"""': re.compile(r'(?:[^"\\]|\\[\s\S]|"(?!""))*'),
}

# _read_calls' outcomes
_OPEN, _CLOSED, _ERROR = "open", "closed", "error"


class PythonicParser(ToolParser):
    name = "pythonic"
    template_markers: ClassVar[tuple[str, ...]] = ()  # a generic format: chosen by name only
    wrapper: ClassVar[tuple[str, str] | None] = None  # (start, end) markers around the list

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        start = _skip_space(text, 0)
        if self.wrapper is not None:
            opening = self.wrapper[0]
            if text.startswith(opening, start):
                start = _skip_space(text, start + len(opening))
            elif not final and opening.startswith(text[start:]) and start < len(text):
                return Parsed()  # may still become the marker
        if start == len(text):
            return Parsed(text if final else "")
        if text[start] != "[":
            return Parsed(text)  # plain text
        calls, state, end = _read_calls(text, start + 1)
        if state != _CLOSED:
            return Parsed(text) if final else Parsed("", calls)
        return Parsed(self._after(text, end, final), calls)

    def _after(self, text: str, end: int, final: bool) -> str:
        """The content after the closed list (and the closing marker)."""
        if self.wrapper is None:
            return text[end:].lstrip(_SPACE)
        rest = text[_skip_space(text, end) :]
        closing = self.wrapper[1]
        if rest.startswith(closing):
            return rest[len(closing) :].lstrip(_SPACE)
        if not final and closing.startswith(rest):
            return ""
        return rest

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        return pythonic_grammar(spec, None)


class Llama4PythonicParser(PythonicParser):
    name = "llama4_pythonic"
    # Llama 4's chat template writes an assistant's calls after <|python_start|> (then JSON, not a list:
    # the models answer with the pythonic list all the same), and no other family's template has it
    template_markers: ClassVar[tuple[str, ...]] = (PYTHON_START,)
    reads_special_tokens = True
    wrapper = (PYTHON_START, PYTHON_END)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        return pythonic_grammar(spec, (lit(PYTHON_START), lit(PYTHON_END)))


# --- reading the list ---------------------------------------------------------------------------------


class _Invalid(Exception):
    """A value that is not a JSON-compatible Python literal."""


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _read_calls(text: str, i: int) -> tuple[list[PartialCall], str, int]:
    """The calls of the list whose ``[`` ends before `i`: (calls, state, offset after ``]``)."""
    calls: list[PartialCall] = []
    n = len(text)
    while True:
        i = _skip_space(text, i)
        if calls and i < n and text[i] == "]":  # `[f(),]`
            return calls, _CLOSED, i + 1
        name = _NAME.match(text, i)
        if name is None:
            return calls, (_OPEN if i == n else _ERROR), i
        i = _skip_space(text, name.end())
        if i == n:
            return calls, _OPEN, i  # the name may go on
        if text[i] != "(":
            return calls, _ERROR, i
        call = PartialCall(name.group())
        calls.append(call)
        state, i = _read_arguments(text, i + 1, call)
        if state != _CLOSED:
            return calls, state, i
        i = _skip_space(text, i)
        if i == n:
            return calls, _OPEN, i
        if text[i] == "]":
            return calls, _CLOSED, i + 1
        if text[i] != ",":
            return calls, _ERROR, i
        i += 1


def _read_arguments(text: str, i: int, call: PartialCall) -> tuple[str, int]:
    """The keyword arguments after a call's ``(``, into `call`: (state, offset after its ``)``)."""
    n = len(text)
    keys: list[str] = []
    while True:
        i = _skip_space(text, i)
        if i == n:
            return _OPEN, i
        if text[i] == ")":  # `f()`, or `f(a=1,)`
            return _close(call, i)
        key = KEY.match(text, i)
        if key is None:
            return _ERROR, i
        i = _skip_space(text, key.end())
        if i == n:
            return _OPEN, i  # the key may go on
        if text[i] != "=" or text.startswith("==", i):
            return _ERROR, i
        end, state = _value_end(text, i + 1)
        if state != _CLOSED:
            return state, end
        try:
            value = _literal(text[i + 1 : end])
        except _Invalid:
            return _ERROR, i
        if key.group() in keys:
            return _ERROR, i
        keys.append(key.group())
        item = f"{json.dumps(key.group(), ensure_ascii=False)}: {arguments_text(value)}"
        call.arguments = f"{call.arguments}, {item}" if call.arguments else "{" + item
        if text[end] == ")":
            return _close(call, end)
        i = end + 1


def _close(call: PartialCall, paren: int) -> tuple[str, int]:
    call.arguments = (call.arguments or "{") + "}"
    call.complete = True
    return _CLOSED, paren + 1


def _value_end(text: str, i: int) -> tuple[int, str]:
    """Where the value starting at `i` ends: the offset of the ``,`` or ``)`` after it and _CLOSED,
    or (offset, _OPEN) when the text ends first, or (offset, _ERROR)."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            if text.startswith(c * 3, i):
                quote = c * 3
            elif text.startswith(c * 2, i) and i + 2 == n:
                return i, _OPEN  # "" or the start of """
            else:
                quote = c
            body = _STRING_BODY[quote].match(text, i + len(quote))
            j = body.end() if body else n  # (it always matches)
            if j >= n or text[j] == "\\":
                return n, _OPEN  # the text ends in the string (or after its backslash)
            if text[j] == "\n":
                return j, _ERROR
            i = j + len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                return (i, _CLOSED) if c == ")" else (i, _ERROR)
            depth -= 1
        elif c == "," and depth == 0:
            return i, _CLOSED
        i += 1
    return n, _OPEN


def _literal(source: str) -> Any:
    """The JSON value of a Python literal (`_Invalid` when it is not one)."""
    source = source.strip(_SPACE)
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Invalid from None
    return _value(tree.body, source)


def _value(node: ast.AST, source: str) -> Any:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return _string(node, source)
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _Invalid
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand, source)
        if isinstance(operand, bool) or not isinstance(operand, int | float):
            raise _Invalid
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        result: dict[str, Any] = {}
        for key, item in zip(node.keys, node.values, strict=True):
            name = _value(key, source) if key is not None else None
            if not isinstance(name, str):
                raise _Invalid
            result[name] = _value(item, source)
        return result
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _Invalid


def _string(node: ast.Constant, source: str) -> str:
    """A string constant; one written as a JSON string reads as JSON (the grammar writes strings with
    JSON's escapes, and ``\\/`` or a surrogate pair mean something else to Python)."""
    segment = ast.get_source_segment(source, node)
    if segment and segment[0] == '"' and not segment.startswith('"""'):
        try:
            value = json.loads(segment)
        except ValueError:
            pass
        else:
            if isinstance(value, str):
                return value
    return str(node.value)
