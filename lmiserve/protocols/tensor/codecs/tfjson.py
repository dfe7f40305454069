"""TF Serving's JSON dialect: `NaN`/`Inf`/`Infinity` number tokens, pretty dumps in messages, its float
formatting rule (`format_float`) and the 4-space pretty layout of bodies.

Parsing stops after the first complete JSON value (trailing bytes are ignored, as TF Serving does).
Documents are read by `lmiserve.core.jsondoc`: nesting deeper than its MAX_JSON_DEPTH, invalid UTF-8
and lone surrogates are 400s in RapidJSON's words, never a crash.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from lmiserve.core import jsondoc
from lmiserve.core.errors import MalformedBody

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|-?Inf(?:inity)?|NaN')
_DUMP_LIMIT = 256
_RAPIDJSON_MESSAGES = (  # Python's parser messages as RapidJSON (TF Serving's parser) words them
    ("Expecting value", "Invalid value."),
    ("Expecting property name", "Missing a name for object member."),
    ("Expecting ':' delimiter", "Missing a colon after a name of object member."),
    ("Expecting ',' delimiter", "Missing a comma or ']' after an array element."),
    ("Unterminated string", "Missing a closing quotation mark in string."),
    ("Invalid control character", "Invalid encoding in string."),
    ("Invalid \\escape", "Invalid escape character in string."),
)


def parse_document(body: bytes, keep: tuple[str, ...] | None = None) -> object:
    """The first JSON value of `body`. With `keep`, a top-level object nested too deeply is scanned
    iteratively and only the `keep` keys are parsed (TF Serving ignores the others, however deep)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedBody(f"JSON Parse error: Invalid encoding in string. at offset: {exc.start}") from None
    start = len(text) - len(text.lstrip(" \t\r\n"))
    if start == len(text):
        raise MalformedBody("JSON Parse error: The document is empty")
    if "Inf" in text:
        text = _TOKENS.sub(_inf_token, text)
    try:
        value, _ = jsondoc.first_value(text, start)
    except jsondoc.JsonTooDeep:
        if keep is None:
            raise MalformedBody("JSON Parse error: The document is nested too deeply. at offset: 0") from None
        value = _shallow_object(text, start, keep)
    except jsondoc.JsonError as exc:
        raise _parse_error(exc) from None
    return value


def _parse_error(exc: jsondoc.JsonError) -> MalformedBody:
    message = next((m for prefix, m in _RAPIDJSON_MESSAGES if exc.msg.startswith(prefix)), exc.msg)
    if not message.endswith("."):
        message += "."
    return MalformedBody(f"JSON Parse error: {message} at offset: {exc.pos}")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SCALAR = re.compile(r"-?(?:Infinity|NaN|[0-9][0-9eE.+-]*)|true|false|null")


def _shallow_object(text: str, pos: int, keep: tuple[str, ...]) -> dict:
    """Iterative scan of a top-level object: kept keys parsed, the other values only skipped."""
    too_deep = MalformedBody("JSON Parse error: The document is nested too deeply. at offset: 0")
    if text[pos] != "{":
        raise too_deep
    out: dict = {}
    pos = _ws(text, pos + 1)
    while pos < len(text) and text[pos] != "}":
        match = _STRING.match(text, pos)
        if match is None:
            raise MalformedBody(f"JSON Parse error: Missing a name for object member. at offset: {pos}")
        try:
            key = jsondoc.loads(match.group(0))
        except jsondoc.JsonError as exc:
            raise _parse_error(exc) from None
        pos = _ws(text, match.end())
        if pos >= len(text) or text[pos] != ":":
            raise MalformedBody(f"JSON Parse error: Missing a colon after a name of object member. at offset: {pos}")
        pos = _ws(text, pos + 1)
        end = _skip_value(text, pos)
        if key in keep:
            try:
                out[key] = jsondoc.loads(text[pos:end])
            except jsondoc.JsonTooDeep:
                raise too_deep from None
            except jsondoc.JsonNotText as exc:
                raise _parse_error(exc) from None
            except jsondoc.JsonError as exc:
                raise MalformedBody(f"JSON Parse error: Invalid value. at offset: {pos + exc.pos}") from None
        pos = _ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _ws(text, pos + 1)
    if pos >= len(text):
        raise MalformedBody(f"JSON Parse error: Missing a comma or '}}' after an object member. at offset: {pos}")
    return out


def _ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _skip_value(text: str, pos: int) -> int:
    """End of the JSON value starting at `pos`, brackets matched without recursion."""
    if pos < len(text) and text[pos] in "[{":
        depth = 0
        while pos < len(text):
            char = text[pos]
            if char == '"':
                match = _STRING.match(text, pos)
                if match is None:
                    break
                pos = match.end()
                continue
            if char in "[{":
                depth += 1
            elif char in "]}":
                depth -= 1
                if depth == 0:
                    return pos + 1
            pos += 1
        raise MalformedBody(f"JSON Parse error: Missing a comma or ']' after an array element. at offset: {pos}")
    match = (_STRING if pos < len(text) and text[pos] == '"' else _SCALAR).match(text, pos)
    if match is None:
        raise MalformedBody(f"JSON Parse error: Invalid value. at offset: {pos}")
    return match.end()


def _inf_token(match: re.Match) -> str:
    token = match.group(0)
    if token.startswith('"') or token.endswith("inity") or token == "NaN":
        return token
    return "-Infinity" if token.startswith("-") else "Infinity"


# ---- dumps of request values inside error messages ---------------------------------------------------


def dump(value: object) -> str:
    """Pretty dump as TF Serving puts it in messages: objects 4-space indented, arrays on one line, <= 256 bytes."""
    text = _pretty(value, 0)
    raw = text.encode("utf-8")
    return raw[:_DUMP_LIMIT].decode("utf-8", errors="ignore") if len(raw) > _DUMP_LIMIT else text


def _pretty(value: object, level: int) -> str:
    if isinstance(value, dict):
        if not value:
            return "{}"
        pad = "    " * (level + 1)
        members = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_pretty(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(members) + "\n" + "    " * level + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_pretty(v, level + 1) for v in value) + "]"
    return _scalar(value)


def _scalar(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def json_type(value: object) -> str:
    if value is None:
        return "Null"
    if value is True:
        return "True"
    if value is False:
        return "False"
    if isinstance(value, dict):
        return "Object"
    if isinstance(value, list):
        return "Array"
    if isinstance(value, str):
        return "String"
    return "Number"


# ---- output values -------------------------------------------------------------------------------------


def format_float(value: float, single: bool) -> str:
    """%.6g, else %.9g (float32) / %.17g (double) when that does not round-trip; `.0` when no `.`/`e`."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    text = "%.6g" % value
    if single:
        if np.float32(float(text)) != np.float32(value):
            text = "%.9g" % value
    elif float(text) != value:
        text = "%.17g" % value
    if "." not in text and "e" not in text:
        text += ".0"
    return text


def format_floats(values: np.ndarray) -> list[str]:
    """`format_float` over a flat float32/float64 array, the %.6g round-trip check vectorized."""
    single = values.dtype == np.float32
    wide = values.astype(np.float64)
    numbers = wide.tolist()
    texts = ["%.6g" % v for v in numbers]
    finite = np.isfinite(wide)
    with np.errstate(over="ignore", invalid="ignore"):
        back = np.array(texts, dtype=np.float64)
        same = back.astype(np.float32) == values if single else back == wide
    longer = "%.9g" if single else "%.17g"  # always round-trips
    for i in np.flatnonzero(~same & finite).tolist():
        texts[i] = longer % numbers[i]
    for i in np.flatnonzero(~finite).tolist():
        texts[i] = format_float(numbers[i], single)
    return [t + ".0" if "." not in t and "e" not in t and t[-1].isdigit() else t for t in texts]


def error_body(message: str) -> bytes:
    """`{"error": msg}` pretty-printed with a 4-space indent."""
    return ('{\n    "error": ' + json.dumps(message, ensure_ascii=False) + "\n}").encode("utf-8")


def document(key: str, rendered: str) -> bytes:
    """A response `{"<key>": <rendered>}` in TF Serving's layout (a top-level list closes on its own line)."""
    if rendered.startswith("[") and rendered.endswith("]") and rendered != "[]":
        rendered = rendered[:-1] + "\n    ]"
    return ('{\n    "' + key + '": ' + rendered + "\n}").encode("utf-8")
