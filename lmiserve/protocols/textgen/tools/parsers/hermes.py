"""``hermes``: each call a JSON object in its own ``<tool_call>`` block (Hermes 2 Pro, Qwen2.5, Qwen3):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before, between and after the blocks is content (whitespace between and after calls is dropped).
A block whose JSON is not a call is plain text; one whose closing marker never came is a call when the
output ends right after its JSON (vLLM reads it so too).
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
    lark_json,
    lark_one_of,
    repeat_calls,
    text_literal,
)
from lmiserve.protocols.textgen.tools.parsers.blocks import (
    OPTIONAL_WS,
    Block,
    json_block,
    read_blocks,
    read_json,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NEWLINE = '"\\n"'  # a Lark literal


class HermesParser(ToolParser):
    name = "hermes"
    template_markers: ClassVar[tuple[str, ...]] = (OPEN,)
    reads_special_tokens = True  # Hermes 2 Pro's <tool_call> is a special token (Qwen's an ordinary added one)

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        return read_blocks(text, final=final, markers=(OPEN,), read_block=_block)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        call = lark_one_of([lark_json(call_object_schema(f)) for f in spec.functions])
        block = f'{lit(OPEN)} "\\n" {call} "\\n" {lit(CLOSE)}'
        return lark_grammar(f"{OPTIONAL_WS} {repeat_calls('call', NEWLINE, spec)}", {"call": block})


def _block(text: str, start: int, marker: str, final: bool) -> Block | None:
    at = skip_ws(text, start)
    if at == len(text):
        return None if final else Block()
    if text[at] != "{":
        return None
    return json_block(read_json(text, at, "object"), final, CLOSE)
