"""``json``: lmiserve's own call format for chat templates that know no tools. The tools and the format
(``{"name": <function>, "parameters": <arguments>}``, or a JSON array of such calls) are described in the
system prompt (`lmiserve.protocols.textgen.tools.prompt`); ``required`` and a named function generate
under a JSON-schema grammar (`lmiserve.protocols.textgen.tools.schema`), ``auto`` freely: an answer that
is not such JSON is plain text.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.output import ToolOutput
from lmiserve.protocols.textgen.tools.parsers.base import (
    CallReader,
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    text_literal,
)
from lmiserve.protocols.textgen.tools.schema import output_grammar


class JsonParser(ToolParser):
    name = "json"

    def reader(self, functions: Sequence[Function] = ()) -> CallReader:
        return ToolOutput()

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        output = ToolOutput()
        output.feed(text)
        if final:
            output.finish()
        calls = [PartialCall(c.name, c.arguments or "", True) for c in output.calls]
        return Parsed(output.content or "", calls)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        return output_grammar(spec)
