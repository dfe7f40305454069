"""What every tool-call parser is: how a model family writes its calls, read back as OpenAI's calls.

A parser (`ToolParser`) is stateless. It reads the whole text generated so far with `parse` and says what
is known: the plain text outside calls (`Parsed.content`) and the calls (`PartialCall`: the name once it
is complete, the arguments as JSON text so far). `SnapshotReader` feeds it a growing text, piece by piece
as tokens arrive, and turns the difference between two snapshots into the stream's pieces (`Content`,
`CallStart`, `Arguments`; `lmiserve.protocols.textgen.tools.output`), so one `parse` serves the whole
answer and the stream alike.

A parser's `parse` must be *prefix-stable* while `final` is False: a later snapshot of a longer text never
takes back what an earlier one said (content only grows; a call's name never changes; its arguments only
grow). To keep that promise it holds back text that may still become a marker (``<tool_ca``) and
arguments that may still change (a value not yet complete). With `final` True the text is complete: a
call that never closed or does not parse (malformed JSON, an unknown shape) is plain text again, never an
error.

`grammar` constrains the output to the family's own call syntax with arguments valid for the tools'
schemas (``tool_choice`` ``required`` or a named function). It is llguidance Lark (`Grammar` kind
``ebnf``) with the arguments as ``%json{...}``; every marker is written with `lit`, which the caller gives
so that a marker that is one special token of the model's tokenizer is matched as that token.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.output import Arguments, Call, CallStart, Content, Piece
from lmiserve.protocols.textgen.tools.schema import MAX_PARALLEL_CALLS, arguments_schema

Literal_ = Callable[[str], str]  # marker text -> a Lark expression matching it


def text_literal(text: str) -> str:
    """A Lark string literal matching `text` (the default `lit`: markers as plain text)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass
class PartialCall:
    """One call as far as it is known: `name` None until the whole name was read; `arguments` the JSON
    text of its arguments so far (an object once `complete`)."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    """A snapshot: the text outside calls, and the calls in order."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class CallReader(Protocol):
    """One generated answer read as text and calls (one per choice): `feed` a token's text, `finish` at
    the end; `calls` are the complete calls, `content` the text outside them (None when the answer is
    calls only), `done` whether no call was left unfinished."""

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...

    @property
    def calls(self) -> list[Call]: ...

    @property
    def content(self) -> str | None: ...

    @property
    def done(self) -> bool: ...


class ToolParser(ABC):
    """A model family's tool-call format (vLLM's ``--tool-call-parser`` names)."""

    name: ClassVar[str]
    # strings whose presence in a chat template's source shows it writes calls this way (`auto`)
    template_markers: ClassVar[tuple[str, ...]] = ()
    # the markers are special tokens in the family's tokenizers: the reader needs their text
    reads_special_tokens: ClassVar[bool] = False
    # every answer is written in the format, with tools or not (gpt-oss's harmony channels): always read
    reads_every_answer: ClassVar[bool] = False

    def __init__(self) -> None:
        # how a grammar matches a marker: the serving layer sets it from the model's tokenizer (a marker
        # that is one special token is matched as that token)
        self.lit: Literal_ = text_literal

    @abstractmethod
    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        """What `text` (the whole output so far) says; see the module docstring."""

    @abstractmethod
    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        """The constraint for ``required`` (one or more calls of `spec.functions`, one when not
        `spec.parallel`) and ``named`` (one call of `spec.functions[0]`)."""

    def reader(self, functions: Sequence[Function] = ()) -> CallReader:
        return SnapshotReader(self, functions)

    def call_id(self) -> str:
        """A new call's id (OpenAI's shape; a family whose template checks ids overrides it)."""
        return f"call_{uuid.uuid4().hex[:24]}"


class SnapshotReader:
    """`CallReader` over a parser's snapshots (see the module docstring)."""

    def __init__(self, parser: ToolParser, functions: Sequence[Function] = ()):
        self.parser, self.functions = parser, list(functions)
        self.text = ""
        self._parsed = Parsed()
        self._content = ""  # content reported
        self._names: list[str] = []  # calls reported (their names)
        self._arguments: list[str] = []  # arguments reported, per reported call
        self._final = False

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        return self._update(self.parser.parse(self.text, final=False, functions=self.functions))

    def finish(self) -> list[Piece]:
        self._final = True
        return self._update(self.parser.parse(self.text, final=True, functions=self.functions))

    def _update(self, parsed: Parsed) -> list[Piece]:
        self._parsed = parsed
        pieces: list[Piece] = []
        if len(parsed.content) > len(self._content) and parsed.content.startswith(self._content):
            pieces.append(Content(parsed.content[len(self._content) :]))
            self._content = parsed.content
        for index, call in enumerate(parsed.calls):
            if index == len(self._names):
                if call.name is None:
                    break
                self._names.append(call.name)
                self._arguments.append("")
                pieces.append(CallStart(index, call.name))
            if call.name != self._names[index]:
                continue  # a snapshot that contradicts what was sent: nothing more for this call
            sent = self._arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                pieces.append(Arguments(index, call.arguments[len(sent) :]))
                self._arguments[index] = call.arguments
        return pieces

    @property
    def calls(self) -> list[Call]:
        return [
            Call(index, c.name, closed=True, arguments=c.arguments)
            for index, c in enumerate(c for c in self._parsed.calls if c.complete and c.name is not None)
        ]

    @property
    def content(self) -> str | None:
        content = self._parsed.content
        if self.calls and not content.strip():
            return None
        return content

    @property
    def done(self) -> bool:
        return all(c.complete for c in self._parsed.calls)


# --- helpers for the parsers ------------------------------------------------------------------------


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers` (text to hold
    back: it may still become a marker)."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def arguments_text(value: Any) -> str:
    """Arguments (a JSON value the model wrote) as OpenAI's arguments string."""
    return json.dumps(value, ensure_ascii=False)


def call_object_schema(function: Function, name_key: str = "name", arguments_key: str = "arguments") -> dict[str, Any]:
    """``{name_key: <the name>, arguments_key: <its arguments>}``: a JSON call as most families write it."""
    return {
        "type": "object",
        "properties": {
            name_key: {"type": "string", "const": function.name},
            arguments_key: arguments_schema(function.parameters),
        },
        "required": [name_key, arguments_key],
        "additionalProperties": False,
    }


# between JSON tokens at most one space (`{"name": "f"}` as the families write it): free whitespace lets a
# weak model loop on newlines inside a call
JSON_WHITESPACE = {"whitespace_pattern": " ?"}


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark expression for a JSON value valid under `schema` (at most one space between its tokens)."""
    options = {**JSON_WHITESPACE, **schema.get("x-guidance", {})}
    return "%json" + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def lark_one_of(expressions: Sequence[str]) -> str:
    return expressions[0] if len(expressions) == 1 else "(" + " | ".join(expressions) + ")"


def repeat_calls(call: str, separator: str, spec: ToolChoice) -> str:
    """`call` once, or 1 to `MAX_PARALLEL_CALLS` times with `separator` between when `spec` allows
    several (a Lark expression)."""
    if not spec.parallel or spec.mode == "named":
        return call
    return f"{call} ({separator} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}"


def lark_grammar(start: str, rules: dict[str, str] | None = None) -> Grammar:
    """A `Grammar` of Lark rules (``start`` first)."""
    lines = [f"start: {start}", *(f"{name}: {body}" for name, body in (rules or {}).items())]
    return Grammar("ebnf", "\n".join(lines))
