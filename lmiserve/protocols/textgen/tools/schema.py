"""The JSON Schema a tool-calling answer is generated under (as a `Grammar`).

One call is ``{"name": <tool name>, "parameters": <its arguments>}`` (the format TGI's tool prompt and
Llama 3's JSON tool calls use). The name comes first in the schema, so it is generated, and streamed,
before the arguments (and "name" sorts before "parameters" too, should keys ever be sorted); the
arguments' properties keep the client's order. The answer is one of:

- ``auto``: one call of any tool, several calls (below), or ``{"content": "<plain answer>"}``, which
  becomes the message's content;
- ``required``: one call of any tool, or several calls;
- ``named``: one call of that tool.

Arguments are generated without undeclared properties (``additionalProperties: false`` unless the
tool's schema sets it): still valid for the tool's own schema, and a weak model cannot pad them.

Several calls are a JSON array of 1 to `MAX_PARALLEL_CALLS` calls, allowed unless
``parallel_tool_calls`` is false (and never for a named tool). The bound keeps a weak model from
spending its whole token budget on calls; a call cut off by ``max_tokens`` is never returned.
"""

from __future__ import annotations

import json
from typing import Any

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice

MAX_PARALLEL_CALLS = 8
NO_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The arguments as generated: only the declared properties unless the schema says otherwise (a
    schema without ``additionalProperties`` allows any other key, and a weak model invents some)."""
    if (
        parameters.get("properties")
        and "additionalProperties" not in parameters
        and "patternProperties" not in parameters
    ):
        return {**parameters, "additionalProperties": False}
    return parameters


def call_schema(function: Function) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "const": function.name},
            "parameters": arguments_schema(function.parameters),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _one_of(options: list[dict[str, Any]]) -> dict[str, Any]:
    return options[0] if len(options) == 1 else {"anyOf": options}


def output_schema(spec: ToolChoice) -> dict[str, Any]:
    """The schema of the whole answer (`spec` must be active)."""
    if not spec.active:
        raise ValueError("no tool can be called")
    calls = [call_schema(f) for f in spec.functions]
    options = list(calls)
    if spec.parallel and spec.mode != "named":
        options.append({"type": "array", "items": _one_of(calls), "minItems": 1, "maxItems": MAX_PARALLEL_CALLS})
    if spec.mode == "auto":
        options.append(NO_TOOL)
    return _one_of(options)


def output_grammar(spec: ToolChoice) -> Grammar:
    return Grammar("json_schema", json.dumps(output_schema(spec), ensure_ascii=False))
