"""``mistral``: calls after ``[TOOL_CALLS]``, in either of Mistral's two formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (v0.3 and until v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}  (v11 tokenizers on)

the second also without ``[ARGS]`` (``[TOOL_CALLS]get_weather{...}``, the text vLLM reads when the
tokenizer hides that token). Text before ``[TOOL_CALLS]`` is content, as is text after the calls;
what does not parse is plain text. Call ids are 9 letters and digits: Mistral's templates reject others.

The grammar writes the array, or the second format when the tokenizer has an ``[ARGS]`` token (`lit`
matches it as that token): the format the model was trained on.
"""

from __future__ import annotations

import random
import string
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
from lmiserve.protocols.textgen.tools.schema import MAX_PARALLEL_CALLS, arguments_schema

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
ID_CHARS = string.ascii_letters + string.digits
_random = random.SystemRandom()


class MistralParser(ToolParser):
    name = "mistral"
    template_markers: ClassVar[tuple[str, ...]] = (MARKER,)
    reads_special_tokens = True

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        return read_blocks(text, final=final, markers=(MARKER,), read_block=_block)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        args = lit(ARGS)
        if args.startswith('"'):  # no [ARGS] token: v0.3's array
            calls = array_grammar([call_object_schema(f) for f in spec.functions], spec)
            return lark_grammar(f"{OPTIONAL_WS} {lit(MARKER)} {OPTIONAL_WS} {calls}")
        # a tokenizer with [ARGS] (v11 on) writes each call as [TOOL_CALLS]NAME[ARGS]{...}
        each = [f"{text_literal(f.name)} {args} {lark_json(arguments_schema(f.parameters))}" for f in spec.functions]
        several = spec.parallel and spec.mode != "named"
        start = f"{OPTIONAL_WS} call{{1,{MAX_PARALLEL_CALLS}}}" if several else f"{OPTIONAL_WS} call"
        return lark_grammar(start, {"call": f"{lit(MARKER)} {lark_one_of(each)}"})

    def call_id(self) -> str:
        return "".join(_random.choices(ID_CHARS, k=9))


def _block(text: str, start: int, marker: str, final: bool) -> Block | None:
    at = skip_ws(text, start)
    if at == len(text):
        return None if final else Block()
    if text[at] == "[":
        return json_block(read_json(text, at, "array"), final)
    return _named(text, at, final)


def _named(text: str, start: int, final: bool) -> Block | None:
    """``NAME[ARGS]{...}`` (or ``NAME{...}``) from `start`."""
    end = start
    while end < len(text) and text[end] in NAME_CHARS:
        end += 1
    rest = text[end:]
    if rest.startswith(ARGS):
        arguments = end + len(ARGS)
    elif rest.startswith("{"):
        arguments = end
    elif not final and ARGS.startswith(rest):  # the name or the marker after it is not complete
        return Block()
    else:
        return None
    if end == start:
        return None
    name = text[start:end]
    at = skip_ws(text, arguments)
    if at == len(text):
        return None if final else Block([PartialCall(name)])
    if text[at] != "{":
        return None if final else Block([PartialCall(name)])  # reported: stays a call until the end
    scan = read_json(text, at, "arguments")
    [call] = scan.calls(complete=True)
    if scan.valid:
        return Block([PartialCall(name, call.arguments, complete=True)], scan.end)
    return None if final else Block([PartialCall(name, call.arguments)])
