"""``granite``: the calls as a JSON array after ``<|tool_call|>`` (Granite 3.x):

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

``<tool_call>`` before the array is read the same way (vLLM accepts it: Granite 3.1 writes it as text
at times). Text before the marker is content, as is text after the array; an array that is not calls
is plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.parsers.base import (
    Literal_,
    Parsed,
    ToolParser,
    call_object_schema,
    lark_grammar,
    text_literal,
)
from lmiserve.protocols.textgen.tools.parsers.blocks import (
    OPTIONAL_WS,
    Block,
    array_grammar,
    json_block,
    read_blocks,
    read_json,
    skip_ws,
)

MARKER = "<|tool_call|>"
MARKERS = (MARKER, "<tool_call>")


class GraniteParser(ToolParser):
    name = "granite"
    template_markers: ClassVar[tuple[str, ...]] = (MARKER,)
    reads_special_tokens = True

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        return read_blocks(text, final=final, markers=MARKERS, read_block=_block)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        calls = array_grammar([call_object_schema(f) for f in spec.functions], spec)
        return lark_grammar(f"{OPTIONAL_WS} {lit(MARKER)} {OPTIONAL_WS} {calls}")


def _block(text: str, start: int, marker: str, final: bool) -> Block | None:
    at = skip_ws(text, start)
    if at == len(text):
        return None if final else Block()
    if text[at] != "[":
        return None
    return json_block(read_json(text, at, "array"), final)
