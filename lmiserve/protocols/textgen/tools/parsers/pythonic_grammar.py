"""The grammar of pythonic calls: ``[name(key=value, ...), ...]`` with values valid for the tool's schema.

Each call writes the declared properties as keyword arguments in the schema's order: the required ones
always, the others when the model wants them. A value is a Python literal of the property's type:

- ``string``, ``number``, ``integer``, and arrays and objects made only of these: the JSON text
  (``%json``, every JSON Schema constraint held), which is also a Python literal of the same value
  (strings with JSON's escapes, which the parser reads as JSON);
- ``boolean``: ``True``/``False``; ``null``: ``None``; ``enum``/``const``: the values as Python literals;
  a list of types or ``anyOf``/``oneOf``: one of the alternatives;
- arrays of other items: ``[item, ...]`` (``minItems``/``maxItems`` held); objects with other
  properties: a ``{"key": value, ...}`` dict in the same way as keyword arguments (undeclared keys
  never written);
- anything else (no type, ``$ref``, ``allOf``, ``not``, ``if``, ``patternProperties``, objects with no
  declared properties but booleans or nulls inside): any Python literal (strings, numbers,
  ``True``/``False``/``None``, lists and dicts of them), not held to the schema.

A tool whose schema declares no properties is called with no arguments, ``name()``; an optional property
whose name cannot be written as a keyword (spaces, quotes, brackets, ``=`` or ``,`` in it) is left out.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lmiserve.core.grammar import Grammar
from lmiserve.protocols.textgen.tools.functions import ToolChoice
from lmiserve.protocols.textgen.tools.parsers.base import (
    lark_grammar,
    lark_json,
    lark_one_of,
    repeat_calls,
    text_literal,
)
from lmiserve.protocols.textgen.tools.schema import arguments_schema

KEY = re.compile(r"[^\s=,()\[\]{}'\"]+")  # a keyword argument's name, as the parser reads it
_SAFE_TYPES = ("string", "number", "integer", "array", "object")
_UNSAFE_KEYS = ("$ref", "allOf", "not", "if", "patternProperties")
_STRING = lark_json({"type": "string"})
_NUMBER = lark_json({"type": "number"})


def pythonic_grammar(spec: ToolChoice, wrapper: tuple[str, str] | None) -> Grammar:
    """The list of calls, between `wrapper` (the Lark expressions of its markers) or without when None."""
    rules = _Rules()
    functions = spec.functions[:1] if spec.mode == "named" else spec.functions
    calls = []
    for function in functions:
        schema = arguments_schema(function.parameters)
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        items = [
            (f"{key}=", rules.value(value), key in required)
            for key, value in properties.items()
            if key in required or KEY.fullmatch(key)
        ]
        inner = rules.sequence(items)
        opening = text_literal(function.name + "(")
        calls.append(rules.add(f'{opening} {inner} ")"' if inner else f'{opening} ")"', "call"))
    listed = f'"[" {repeat_calls(lark_one_of(calls), text_literal(", "), spec)} "]"'
    if wrapper is not None:
        listed = f"({wrapper[0]} {listed} {wrapper[1]} | {listed})"
    return lark_grammar(f"WS? {listed}", {**rules.rules, "WS": r"/[ \t\r\n]+/"})


class _Rules:
    """Lark rules made while writing one grammar."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._any: str | None = None

    def add(self, body: str, hint: str = "r") -> str:
        name = f"{hint}_{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema: Any) -> str:
        """A Lark expression for a Python literal valid under `schema`."""
        if not isinstance(schema, dict) or not schema:
            return self.any()
        if "const" in schema:
            return text_literal(py_literal(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return lark_one_of([text_literal(py_literal(v)) for v in schema["enum"]])
        schema = _closed(schema)
        if _json_safe(schema):
            return lark_json(schema)
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return lark_one_of([self.value(option) for option in schema[key]])
        kind = schema.get("type")
        if any(key in schema for key in _UNSAFE_KEYS):
            return self.any()
        if isinstance(kind, list) and kind:
            return lark_one_of([self.value({**schema, "type": k}) for k in kind])
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            return self.array(self.value(schema.get("items", True)), schema)
        if kind == "object" and schema.get("properties"):
            required = set(schema.get("required") or ())
            items = [
                (f"{json.dumps(key, ensure_ascii=False)}: ", self.value(value), key in required)
                for key, value in schema["properties"].items()
            ]
            inner = self.sequence(items)
            return self.add(f'"{{" {inner} "}}"' if inner else '"{}"', "dict")
        return self.any()

    def array(self, item: str, schema: dict[str, Any]) -> str:
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        if high is not None and int(high) == 0:
            return '"[]"'
        more = f'(", " {item})'
        if high is None:
            rest = f"{more}*" if low <= 1 else f"{more}{{{low - 1}}} {more}*"
        else:
            rest = f"{more}{{{max(low - 1, 0)},{int(high) - 1}}}"
        inner = f"{item} {rest}" if low >= 1 else f"({item} {rest})?"
        return self.add(f'"[" {inner} "]"', "list")

    def sequence(self, items: list[tuple[str, str, bool]]) -> str:
        """Items (its text before the value, the value, required) in order with ", " between: the
        required always, the others optional. "" when there are none."""
        if not items:
            return ""
        tails = [""] * (len(items) + 1)  # tails[i]: items i.. once one came before
        for i in range(len(items) - 1, 0, -1):
            prefix, value, required = items[i]
            piece = f"{text_literal(', ' + prefix)} {value}"
            expression = piece if required else f"({piece})?"
            tails[i] = self.add(f"{expression} {tails[i + 1]}".strip(), "tail")
        heads = []
        for i, (prefix, value, required) in enumerate(items):
            heads.append(f"{text_literal(prefix)} {value} {tails[i + 1]}".strip())
            if required:
                return lark_one_of(heads)
        return "(" + " | ".join(heads) + ")?"

    def any(self) -> str:
        """Any Python literal made of JSON's values."""
        if self._any is None:
            self._any = name = self.add("", "any")
            pair = f'{_STRING} ": " {name}'
            self.rules[name] = (
                f'{_STRING} | {_NUMBER} | "True" | "False" | "None" | "[" ({name} (", " {name})*)? "]"'
                f' | "{{" ({pair} (", " {pair})*)? "}}"'
            )
        return self._any


def py_literal(value: Any) -> str:
    """`value` (JSON) written as a Python literal."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {py_literal(v)}" for k, v in value.items())
            + "}"
        )
    return json.dumps(value, ensure_ascii=False)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its objects' undeclared properties forbidden where it does not say (as
    `arguments_schema` does for the arguments) and a missing object or array type filled in."""
    result = dict(schema)
    if "type" not in result and "properties" in result:
        result["type"] = "object"
    if "type" not in result and "items" in result:
        result["type"] = "array"
    if isinstance(result.get("properties"), dict):
        result["properties"] = {k: _closed(v) if isinstance(v, dict) else v for k, v in result["properties"].items()}
        if result["properties"] and "additionalProperties" not in result and "patternProperties" not in result:
            result["additionalProperties"] = False
    if isinstance(result.get("items"), dict):
        result["items"] = _closed(result["items"])
    for key in ("anyOf", "oneOf"):
        if isinstance(result.get(key), list):
            result[key] = [_closed(v) if isinstance(v, dict) else v for v in result[key]]
    return result


def _json_safe(schema: Any) -> bool:
    """Every value valid under `schema` is written the same in JSON and Python (no true/false/null)."""
    if not isinstance(schema, dict) or not schema or any(key in schema for key in _UNSAFE_KEYS):
        return False
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = schema[key]
            return isinstance(options, list) and bool(options) and all(_json_safe(o) for o in options)
    if "const" in schema:
        return _plain(schema["const"])
    if "enum" in schema:
        return isinstance(schema["enum"], list) and all(_plain(v) for v in schema["enum"])
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or any(k not in _SAFE_TYPES for k in kinds):
        return False
    if "array" in kinds:
        prefix = schema.get("prefixItems", [])
        if not _json_safe(schema.get("items")) or not all(_json_safe(p) for p in prefix):
            return False
    if "object" in kinds:
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties", True)
        if not all(_json_safe(p) for p in properties.values()):
            return False
        if additional is not False and not _json_safe(additional):
            return False
    return True


def _plain(value: Any) -> bool:
    """No boolean or null anywhere in `value`."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return True
