"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request, validated into a `ToolSpec`.

Accepted shapes (OpenAI's and TGI's):

- `tools`: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``; TGI's
  ``arguments`` is an alias of ``parameters``; an absent ``type`` means ``"function"``; ``strict`` is
  accepted and has no effect (arguments are always constrained to the schema). An empty list is no tools.
- `tool_choice`: ``"none"``, ``"auto"`` (the default with tools), ``"required"``,
  ``{"type": "function", "function": {"name": ...}}``, or (TGI) a bare function name.
- `parallel_tool_calls`: absent or true allows several calls in one answer (OpenAI's default); false
  allows one.

Every problem raises `ToolError` (TGI's 422 ``tool_error``) before anything is generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.errors import ToolError
from lmiserve.protocols.textgen.tools.functions import NAME, NO_PARAMETERS, Function, Mode
from lmiserve.protocols.textgen.tools.parsers import CallReader, ToolParser, tool_parser

__all__ = ["NO_PARAMETERS", "Function", "ToolSpec", "tool_fields", "tool_grammar", "tool_spec"]


@dataclass(frozen=True)
class ToolSpec:
    """What the output may be: `mode` ``none`` (plain text), ``auto`` (text or calls), ``required``
    (calls), ``named`` (one call of `functions[0]`); `parallel`: several calls allowed."""

    functions: list[Function] = field(default_factory=list)
    mode: Mode = "none"
    parallel: bool = False
    prompt: str | None = None  # TGI's `tool_prompt`: replaces the default instruction
    parser: ToolParser | None = None  # the model's call format (None: lmiserve's JSON format, `json`)

    @property
    def active(self) -> bool:
        """The answer is read for tool calls: ``auto``, ``required`` or a named function, with tools."""
        return self.mode != "none" and bool(self.functions)

    @property
    def format(self) -> ToolParser:
        """The parser of the model's call format."""
        if self.parser is not None:
            return self.parser
        return tool_parser("json")

    @property
    def read(self) -> bool:
        """The answer is read in the format: tools are active, or the format writes every answer
        (harmony's channels)."""
        return self.active or self.format.reads_every_answer

    @property
    def native(self) -> bool:
        """The model has a call format of its own (its chat template's), not lmiserve's JSON one."""
        return self.format.name != "json"

    def reader(self) -> CallReader:
        """A reader of one generated answer (one per choice)."""
        return self.format.reader(self.functions)

    def function(self, name: str) -> Function | None:
        return next((f for f in self.functions if f.name == name), None)


def tool_grammar(spec: ToolSpec) -> Grammar | None:
    """The constraint a request's tools put on its answer, in the model's own call format: ``required``
    and a named function must call (`ToolParser.grammar`); ``auto`` and ``none`` leave the model free."""
    if not spec.active or spec.mode == "auto":
        return None
    parser = spec.format
    return parser.grammar(spec, parser.lit)


def tool_fields(tools: ToolSpec, grammar: Grammar | None) -> dict[str, Any]:
    """What tools ask of generation when the answer is read (`ToolSpec.read`), as `SamplingParams` fields:
    ``required`` and a named function generate under the call format's grammar (never beside another
    constraint, the request's `grammar`: TGI's message); a format whose markers are special tokens keeps
    their text in the output."""
    fields: dict[str, Any] = {}
    if tools.active:
        if grammar is not None:  # response_format / guided_* / text.format
            raise ToolError("Grammar and tools are mutually exclusive")
        fields["grammar"] = tool_grammar(tools)
    if tools.read and tools.format.reads_special_tokens:
        fields["skip_special_tokens"] = False
    return fields


def tool_spec(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: Any,
    tool_prompt: str | None = None,
    parser: ToolParser | None = None,
) -> ToolSpec:
    """The validated tool fields of one chat request (raw JSON values as the request carried them);
    `parser`: the model's call format (None: lmiserve's JSON one)."""
    functions = _functions(tools)
    if tool_choice is None:
        mode: Mode = "auto" if functions else "none"
        return ToolSpec(functions, mode, _parallel(parallel_tool_calls), tool_prompt, parser)
    name = _named(tool_choice)
    if name is None:
        mode = tool_choice
        if mode != "none" and not functions:
            raise ToolError(f'`tool_choice` "{mode}" needs `tools`')
        return ToolSpec(functions, mode, _parallel(parallel_tool_calls) and mode != "none", tool_prompt, parser)
    if not functions:
        raise ToolError("`tool_choice` names a function but the request has no `tools`")
    chosen = next((f for f in functions if f.name == name), None)
    if chosen is None:
        raise ToolError(f"Tool with name {name} not found")
    return ToolSpec([chosen], "named", False, tool_prompt, parser)


def _parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ToolError("`parallel_tool_calls` must be a boolean")
    return value


def _named(choice: Any) -> str | None:
    """The function `choice` names, or None for the three modes; `ToolError` for anything else."""
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return None
        return choice  # TGI: a bare function name
    if isinstance(choice, dict):
        kind = choice.get("type", "function")
        function = choice.get("function")
        if kind == "function" and isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise ToolError(
        '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )


def _functions(tools: Any) -> list[Function]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("`tools` must be a list of functions")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f'`tools[{i}]` must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"`tools[{i}].function` must be an object with a `name`")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"`tools[{i}].function.name` must be 1 to 64 letters, digits, '_' or '-'")
        if any(f.name == name for f in functions):
            raise ToolError(f"two tools are named {name}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"`tools[{i}].function.description` must be a string")
        parameters = function.get("parameters", function.get("arguments"))
        functions.append(Function(name, description, _parameters(parameters, f"tools[{i}].function.parameters")))
    return functions


def _parameters(schema: Any, where: str) -> dict[str, Any]:
    """The arguments' JSON Schema: an object schema (absent: no arguments). Deeper problems are found
    when the grammar is compiled (a validation error too)."""
    if schema is None or schema == {}:
        return NO_PARAMETERS
    if not isinstance(schema, dict):
        raise ToolError(f"`{where}` must be a JSON Schema object")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolError(f'`{where}` must describe an object (`"type": "object"`)')
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, dict | bool) for v in properties.values()):
        raise ToolError(f"`{where}.properties` must map names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"`{where}.required` must be a list of property names")
    additional = schema.get("additionalProperties", True)
    if not isinstance(additional, dict | bool):
        raise ToolError(f"`{where}.additionalProperties` must be a boolean or a schema")
    return {**schema, "type": "object"}
