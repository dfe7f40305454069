"""The wire spellings of an output constraint, read into one `Grammar` (or `InvalidRequest`).

- TGI `parameters.grammar`: ``{"type": "json" | "json_object" | "json_schema" | "regex", "value": ...}``
  (a JSON schema as an object or a JSON string; for ``json_schema`` the value is ``{"name"?, "schema"}``);
- OpenAI `response_format`: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  object; TGI's chat also takes a schema in `value`), ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``, and TGI's chat shapes (``json`` / ``regex`` with `value`);
- vLLM: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and the newer
  ``structured_outputs`` object (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``);
- LMI parameters: ``json_schema`` (DJL Serving's spelling), plus all of the above.

Asking for two constraints at once is an error. Whether a schema or regex compiles is the engine's
business (`TextGenerator.prepare`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.grammar import Grammar

VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_OUTPUTS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


def json_schema(schema: Any, what: str = "JSON schema") -> Grammar:
    """A schema given as an object or as JSON text; it must be a JSON object (key order kept)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{what} is not valid JSON: {exc.msg}") from None
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{what} must be a JSON object")
    if not schema:
        return Grammar("json_object")  # {} allows any JSON value; an object is what clients mean
    return Grammar("json_schema", json.dumps(schema, ensure_ascii=False))


def regex(value: Any, what: str = "regex") -> Grammar:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{what} must be a non-empty string")
    return Grammar("regex", value)


def choice(value: Any, what: str = "choice") -> Grammar:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(f"{what} must be a non-empty list of strings")
    return Grammar("choice", json.dumps(value, ensure_ascii=False))


def ebnf(value: Any, what: str = "grammar") -> Grammar:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{what} must be a non-empty string")
    return Grammar("ebnf", value)


def from_tgi(grammar: Any) -> Grammar:
    """TGI's `grammar` parameter."""
    if not isinstance(grammar, Mapping) or "type" not in grammar:
        raise InvalidRequest('grammar must be {"type": "json" | "regex" | "json_schema", "value": ...}')
    kind, value = grammar.get("type"), grammar.get("value")
    if kind in ("json", "json_object"):
        if value is None and kind == "json_object":
            return Grammar("json_object")
        return json_schema(value, "grammar value")
    if kind == "json_schema":
        inner = value.get("schema") if isinstance(value, Mapping) else None
        return json_schema(inner, "grammar value.schema")
    if kind == "regex":
        return regex(value, "grammar value")
    raise InvalidRequest(f"unknown grammar type {kind!r}: expected json, json_object, json_schema or regex")


def from_response_format(response_format: Any) -> Grammar | None:
    """OpenAI's (and TGI chat's) `response_format`; None for ``{"type": "text"}``."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequest("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        value = response_format.get("value", response_format.get("schema"))
        return Grammar("json_object") if value is None else json_schema(value, "response_format value")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, Mapping):
            schema = spec.get("schema")  # optional in OpenAI's API: without it, any JSON object
            return (
                Grammar("json_object") if schema is None else json_schema(schema, "response_format json_schema.schema")
            )
        if "value" in response_format:  # TGI's chat shape
            return from_tgi(response_format)
        raise InvalidRequest("response_format json_schema needs a `json_schema` object")
    if kind in ("json", "regex"):
        return from_tgi(response_format)
    raise InvalidRequest(f"unknown response_format type {kind!r}: expected text, json_object or json_schema")


def from_vllm(fields: Mapping[str, Any]) -> Grammar | None:
    """vLLM's `guided_*` fields and its `structured_outputs` object (at most one constraint)."""
    found: list[Grammar] = []
    given = {name: fields.get(name) for name in VLLM_FIELDS if fields.get(name) is not None}
    structured = fields.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, Mapping):
            raise InvalidRequest("structured_outputs must be an object")
        for key in _STRUCTURED_OUTPUTS:
            if structured.get(key) is not None:
                given[f"structured_outputs.{key}"] = structured[key]
        if structured.get("json_object"):
            found.append(Grammar("json_object"))
    for name, value in given.items():
        if name.endswith("json"):
            found.append(json_schema(value, name))
        elif name.endswith("regex"):
            found.append(regex(value, name))
        elif name.endswith("choice"):
            found.append(choice(value, name))
        else:
            found.append(ebnf(value, name))
    return only_one(*found)


def only_one(*grammars: Grammar | None) -> Grammar | None:
    """The one constraint asked for; InvalidRequest when several are."""
    given = [g for g in grammars if g is not None]
    if len(given) > 1:
        raise InvalidRequest("only one output constraint may be given (response_format, grammar, guided_*)")
    return given[0] if given else None
