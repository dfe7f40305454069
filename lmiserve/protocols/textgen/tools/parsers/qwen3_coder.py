"""``qwen3_coder``: calls as XML-like blocks with raw parameter values (Qwen3-Coder):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=NAME>`` and ``</parameter>`` less one newline at each end
(also ended by the next ``<parameter=`` or ``</function>`` when the model forgot ``</parameter>``, as vLLM
reads it), converted by the type the tool's schema gives that parameter as vLLM's ``qwen3_coder``
parser does: a string stays text, any other type is read as JSON (the text when that fails), and a
parameter the schema does not know is JSON when it reads as JSON, else text. A ``<function=`` block
without ``<tool_call>`` around it is a call too. The arguments are streamed a parameter at a time:
``{"city": "Paris"``, then ``, "days": 3``, then ``}`` at ``</function>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import Function, ToolChoice
from lmiserve.protocols.textgen.tools.json_scan import WHITESPACE
from lmiserve.protocols.textgen.tools.parsers.base import (
    Literal_,
    Parsed,
    PartialCall,
    ToolParser,
    lark_grammar,
    lark_json,
    lark_one_of,
    repeat_calls,
    text_literal,
)
from lmiserve.protocols.textgen.tools.parsers.blocks import OPTIONAL_WS, Block, closing, read_blocks, skip_ws
from lmiserve.protocols.textgen.tools.schema import arguments_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)
NOT_IN_NAME = set(WHITESPACE) | set("<>")
NEWLINE = '"\\n"'  # a Lark literal
NAME_END = ">\n"
# text that does not contain the closing marker (the parser ends a value at the first one)
TEXT = r"/(?s:.*)/ & ~/(?s:.*)<\/parameter>(?s:.*)/"
TEXT_LINES = r"/(?s:.*)\n/ & ~/(?s:.*)<\/parameter>(?s:.*)/"  # the same, ending with a newline
_TYPES = {  # vLLM's names of the JSON Schema types
    "string": "string",
    "str": "string",
    "text": "string",
    "varchar": "string",
    "char": "string",
    "enum": "string",
    "integer": "integer",
    "int": "integer",
    "number": "number",
    "float": "number",
    "double": "number",
    "boolean": "boolean",
    "bool": "boolean",
    "object": "object",
    "dict": "object",
    "array": "array",
    "list": "array",
    "arr": "array",
    "null": "null",
}


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    template_markers: ClassVar[tuple[str, ...]] = (FUNCTION, PARAMETER)

    def parse(self, text: str, *, final: bool, functions: Sequence[Function] = ()) -> Parsed:
        schemas = {f.name: f.parameters for f in functions}

        def block(text: str, start: int, marker: str, final: bool) -> Block | None:
            if marker == OPEN:
                at = skip_ws(text, start)
                rest = text[at:]
                if not rest.startswith(FUNCTION):
                    return Block() if not final and FUNCTION.startswith(rest) else None
                start = at + len(FUNCTION)
            return _function(text, start, final, schemas)

        return read_blocks(text, final=final, markers=(OPEN, FUNCTION), read_block=block)

    def grammar(self, spec: ToolChoice, lit: Literal_ = text_literal) -> Grammar:
        rules: dict[str, str] = {}
        close = lit(PARAMETER_END)
        if close.startswith('"'):  # the marker is text: the value ends at its first newline + marker
            rules["TEXT"] = TEXT
            rules["text_value[lazy]"] = f"TEXT {NEWLINE} {close}"
            text_value = "text_value"
        else:  # a special token ends the value
            rules["TEXT_LINES"] = TEXT_LINES
            text_value = f"TEXT_LINES {close}"
        functions = []
        for i, function in enumerate(spec.functions):
            schema = arguments_schema(function.parameters)
            properties = schema.get("properties") or {}
            required = set(schema.get("required") or ())
            params = []
            for key, value_schema in properties.items():
                head = f"{lit(PARAMETER)} {_literal(key + NAME_END)}"
                if "string" in (_types(value_schema) or ()):
                    value = _string_value(value_schema, close, text_value)
                else:
                    value = f"{lark_json(_json_schema(value_schema))} {NEWLINE} {close}"
                param = f"{head} {value} {NEWLINE}"
                params.append(param if key in required else f"({param})?")
            if schema.get("additionalProperties", True) is not False:
                params.append(f'({lit(PARAMETER)} /[A-Za-z0-9_.\\-]+/ ">\\n" {text_value} {NEWLINE})*')
            rules[f"function{i}"] = " ".join(
                [lit(FUNCTION), _literal(function.name + NAME_END), *params, lit(FUNCTION_END)]
            )
            functions.append(f"function{i}")
        rules["call"] = f"{lit(OPEN)} {NEWLINE} {lark_one_of(functions)} {NEWLINE} {lit(CLOSE)}"
        start = f"{OPTIONAL_WS} {repeat_calls('call', NEWLINE, spec)}"
        return lark_grammar(start, {"call": rules.pop("call"), **rules})


# --- reading ----------------------------------------------------------------------------------------


def _function(text: str, start: int, final: bool, schemas: Mapping[str, dict[str, Any]]) -> Block | None:
    """The call whose name starts at `start` (just past ``<function=``)."""
    end = text.find(">", start)
    name = text[start:] if end < 0 else text[start:end]
    if any(ch in NOT_IN_NAME for ch in name) or (end >= 0 and not name):
        return None
    if end < 0:
        return None if final else Block()
    parameters = schemas.get(name)
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    values: list[str] = []  # "key": value, as JSON text
    pos, closed = end + 1, None
    while True:
        param, function_end = text.find(PARAMETER, pos), text.find(FUNCTION_END, pos)
        if function_end >= 0 and (param < 0 or function_end < param):
            closed = function_end + len(FUNCTION_END)
            break
        key_end = text.find(">", param + len(PARAMETER)) if param >= 0 else -1
        if key_end < 0:
            break
        key = text[param + len(PARAMETER) : key_end]
        value_end, pos = _value_end(text, key_end + 1)
        if value_end < 0:
            break
        raw = _strip_newline(text[key_end + 1 : value_end])
        schema = properties.get(key) if isinstance(properties, dict) else None
        value = _convert(raw, schema)
        values.append(f"{_dumps(key)}: {_dumps(value)}")
    arguments = "{" + ", ".join(values) if values or closed is not None else ""
    if closed is None:
        return None if final else Block([PartialCall(name, arguments)])
    return closing(text, closed, CLOSE, [PartialCall(name, arguments + "}")], final)


def _value_end(text: str, start: int) -> tuple[int, int]:
    """(end of the value that starts at `start`, where the text after it starts); -1 while open."""
    found = [(at, marker) for marker in VALUE_ENDS if (at := text.find(marker, start)) >= 0]
    if not found:
        return -1, -1
    at, marker = min(found)
    return at, at + len(marker) if marker == PARAMETER_END else at


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_NOT_JSON = object()


def _reject(constant: str) -> Any:
    raise ValueError(constant)  # NaN and Infinity are not JSON


def _json(raw: str) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject)
    except ValueError:
        return _NOT_JSON


def _convert(raw: str, schema: Any) -> Any:
    """A parameter's value from its text, by its schema (None: a parameter or tool the request does not
    declare)."""
    types = _types(schema) if isinstance(schema, dict) else None
    if types == {"string"}:
        return raw
    if types and "boolean" in types and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    value = _json(raw)
    if value is _NOT_JSON:
        return raw
    if types and "string" in types and not (_type_of(value) & types):
        return raw  # e.g. "123" for a string-or-null parameter
    return value


def _types(schema: Any) -> set[str] | None:
    """The JSON types `schema` allows (vLLM's type names understood too), None when it does not say."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {_TYPES.get(kind.strip().lower(), "unknown")}
    if isinstance(kind, list):
        return {_TYPES.get(str(k).strip().lower(), "unknown") for k in kind} or None
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return {"string"}
    if isinstance(schema.get("const"), str):
        return {"string"}
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            found: set[str] = set()
            for option in options:
                option_types = _types(option)
                if option_types is None:
                    return None
                found |= option_types
            return found
    return None


def _type_of(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


# --- the grammar ------------------------------------------------------------------------------------


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _string_value(schema: dict[str, Any], close: str, text_value: str) -> str:
    """A string parameter's value through its closing marker: one of its `enum` strings, else any text."""
    choices = schema.get("enum")
    if (
        schema.get("type") == "string"
        and isinstance(choices, list)
        and choices
        and all(isinstance(c, str) and PARAMETER_END not in c for c in choices)
    ):
        return f"{lark_one_of([_literal(c) for c in choices])} {NEWLINE} {close}"
    return text_value


def _json_schema(schema: Any) -> dict[str, Any]:
    return schema if isinstance(schema, dict) else {}
