"""``llama3_json``: the answer is the calls, JSON objects (Llama 3.1, 3.2 and 3.3):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

after optional whitespace and an optional ``<|python_tag|>``; ``"arguments"`` is read like
``"parameters"``; calls are separated by ``;`` (vLLM's reading) or whitespace. An answer that does not
start with ``{`` or ``<|python_tag|>`` is plain text, and so is one whose calls do not all parse (at
the end of the output); text after the last call is content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.parsers.base import (
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    call_object_schema,
    lark_grammar,
    lark_json,
    lark_one_of,
    repeat_calls,
    text_literal,
)
from lmiserve.protocols.textgen.tools.parsers.blocks import OPTIONAL_WS, read_json, skip_ws

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
GRAMMAR_SEPARATOR = '"; "'  # a Lark literal: the separator as vLLM's template and docs write it


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    # Llama 3.1 and 3.3 write builtin-tool calls after <|python_tag|>; 3.1, 3.2 and 3.3 all give tool
    # results the ipython role in this header. Llama 4's template has neither (its JSON instructions
    # and "Environment: ipython" are the same as 3.x's, so those would not tell them apart).
    template_markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "<|start_header_id|>ipython<|end_header_id|>")
    reads_special_tokens = True

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        at = skip_ws(text, 0)
        rest = text[at:]
        if not final and PYTHON_TAG.startswith(rest):  # nothing yet, or maybe the tag
            return Parsed()
        if rest.startswith(PYTHON_TAG):
            at = skip_ws(text, at + len(PYTHON_TAG))
        if at == len(text):  # whitespace and maybe the tag: nothing to say until the end
            return Parsed(text) if final else Parsed()
        if text[at] != "{":
            return Parsed(text)
        calls: list[PartialCall] = []
        while at < len(text) and text[at] == "{":
            scan = read_json(text, at, "object")
            if not scan.valid:
                if final or (scan.broken and not calls and not scan.named):
                    return Parsed(text)  # not calls after all
                return Parsed("", calls + scan.calls(complete=False))
            calls += scan.calls(complete=True)
            assert scan.end is not None
            end = scan.end
            at = skip_ws(text, end)
            if at < len(text) and text[at] == SEPARATOR:
                at = skip_ws(text, at + 1)
            if at < len(text) and text[at] != "{":  # the text after the calls
                return Parsed(text[end:], calls)
        return Parsed("", calls)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        call = lark_one_of([lark_json(call_object_schema(f, arguments_key="parameters")) for f in spec.functions])
        start = f"{OPTIONAL_WS} ({lit(PYTHON_TAG)})? {repeat_calls('call', GRAMMAR_SEPARATOR, spec)}"
        return lark_grammar(start, {"call": call})
