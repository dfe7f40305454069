"""The one reader of JSON request bodies: strict UTF-8 text, at most `MAX_JSON_DEPTH` levels of
nesting, no lone surrogates in strings.

Every protocol parses a request's JSON through `loads` (or `first_value` / `all_values` for TF
Serving's "first value, trailing bytes ignored" and SageMaker's several top-level values). Each failure
is a `JsonError`, a `ValueError`, so a caller's ``except ValueError`` keeps answering it with its
protocol's own parse-failure message:

- not UTF-8 text (or a `str` holding surrogates): `JsonNotText`, the codec's message;
- not JSON: `JsonSyntaxError`, the `json` module's message (``Expecting value: line 1 column 1 (char 0)``);
- nested deeper than `MAX_JSON_DEPTH` arrays/objects: `JsonTooDeep`,
  ``the JSON document is nested deeper than 64 levels``. The depth is measured on the raw bytes before
  parsing (escapes and strings dropped, then a running count of brackets), so a hostile document never
  reaches the recursive parser and `RecursionError` never escapes;
- a string holding a lone UTF-16 surrogate escape (``"\\ud800"``, valid JSON grammar but not Unicode
  text, refused by TGI's serde_json and Triton/TF Serving's RapidJSON alike): `JsonNotText`, so no
  prompt, tensor element or parameter downstream ever holds text that cannot be encoded.

`NaN`, `Infinity` and `-Infinity` are accepted as Python's `json` accepts them; what a value may be
is the schema's business. Cost on a 50 MB list of floats: see docs/hostile-input.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64
"""Arrays and objects nest at most this deep in a request document (``[[1]]`` is 2 levels). A rank-64
tensor or a 64-level tool schema is far beyond any real request; RapidJSON and serde_json default
to 128 and the recursive parser of Python breaks near 1000."""

_ESCAPE = re.compile(rb"\\.", re.S)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONG_NUMBER = "the JSON document holds an integer with too many digits"


class JsonError(ValueError):
    """The body is not a JSON document lmiserve reads. `msg` says what (no position), `pos` is the
    character offset where it was found; ``str()`` is the full message."""

    def __init__(self, message: str, msg: str | None = None, pos: int = 0, lineno: int = 1, colno: int = 1):
        super().__init__(message)
        self.msg = msg if msg is not None else message
        self.pos = pos
        self.lineno = lineno
        self.colno = colno


class JsonSyntaxError(JsonError):
    """Not JSON: the `json` module's message."""


class JsonNotText(JsonError):
    """Not UTF-8 text, or a string holding a lone surrogate."""


class JsonTooDeep(JsonError):
    """Arrays/objects nested deeper than the limit."""

    def __init__(self, limit: int = MAX_JSON_DEPTH):
        super().__init__(f"the JSON document is nested deeper than {limit} levels")


def text_of(data: bytes | str) -> str:
    """`data` as text: bytes must be UTF-8 (a leading byte-order mark is dropped); `JsonNotText`."""
    return _text_and_bytes(data)[0]


def loads(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The one JSON document of `data` (whitespace around it allowed); `JsonError` (a ValueError) if
    it is not UTF-8, not JSON, nested deeper than `max_depth`, or holds a lone surrogate."""
    text, raw = _text_and_bytes(data)
    _check_depth(raw, max_depth, first_only=False)
    with _decoding(max_depth):
        value = json.loads(text)
    _check_strings(raw, value)
    return value


def first_value(data: bytes | str, pos: int = 0, *, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, int]:
    """The JSON value starting at character `pos` and the offset after it (what follows is not
    read); the checks of `loads`, the depth counted over that first value only."""
    text, raw = _text_and_bytes(data)
    _check_depth(raw[len(text[:pos].encode("utf-8")) :] if pos else raw, max_depth, first_only=True)
    value, end = _raw_decode(json.JSONDecoder(), text, pos, max_depth)
    _check_strings(raw, value)
    return value, end


def all_values(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> list[Any]:
    """Every top-level JSON value of `data` (JSON Lines, or values separated by whitespace)."""
    text, raw = _text_and_bytes(data)
    _check_depth(raw, max_depth, first_only=False)
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos >= len(text):
            break
        value, pos = _raw_decode(decoder, text, pos, max_depth)
        values.append(value)
    _check_strings(raw, values)
    return values


def _text_and_bytes(data: bytes | str) -> tuple[str, bytes]:
    """(text, its UTF-8 bytes). Bytes must decode as UTF-8, a str must encode (no surrogates);
    anything else is a TypeError, as for `json.loads`."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, (bytes, str)):
        raise TypeError(f"the JSON document must be str or bytes, not {type(data).__name__}")
    try:
        if isinstance(data, str):
            return data, data.encode("utf-8")
        return data.decode("utf-8-sig"), data
    except UnicodeError as exc:
        raise JsonNotText(str(exc), "Invalid encoding in string.", getattr(exc, "start", 0)) from None


def _check_depth(raw: bytes, max_depth: int, *, first_only: bool) -> None:
    """`JsonTooDeep` if arrays/objects in the UTF-8 text `raw` nest deeper than `max_depth` (with
    `first_only`, in its first value only). Escapes and strings are dropped first, so brackets in
    strings do not count (UTF-8 never puts an ASCII byte inside a multi-byte character); never
    recursive, linear time."""
    brackets = raw.translate(None, _NOT_BRACKETS)
    if len(brackets) <= max_depth:
        return
    if b"\\" in raw or b'"' in raw:
        if b"\\" in raw:
            raw = _ESCAPE.sub(b"", raw)
        brackets = _STRING.sub(b"", raw.translate(None, _NOT_STRUCTURE)).translate(None, _NOT_BRACKETS)
        if len(brackets) <= max_depth:
            return
    depth = np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int32)
    if first_only:
        closed = np.flatnonzero(depth <= 0)
        if closed.size:
            depth = depth[: closed[0] + 1]
    if int(depth.max()) > max_depth:
        raise JsonTooDeep(max_depth)


def _raw_decode(decoder: json.JSONDecoder, text: str, pos: int, max_depth: int) -> tuple[Any, int]:
    with _decoding(max_depth):
        return decoder.raw_decode(text, pos)


@contextlib.contextmanager
def _decoding(max_depth: int) -> Iterator[None]:
    """The json module's failures as `JsonError`s."""
    try:
        yield
    except json.JSONDecodeError as exc:
        raise JsonSyntaxError(str(exc), exc.msg, exc.pos, exc.lineno, exc.colno) from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise JsonSyntaxError(_LONG_NUMBER, _LONG_NUMBER) from None
    except RecursionError:  # unreachable after the depth check; kept so that it can never escape
        raise JsonTooDeep(max_depth) from None


def _check_strings(raw: bytes, value: Any) -> None:
    """`JsonNotText` if a string (or key) of `value` holds a lone surrogate. The UTF-8 text `raw` holds
    no surrogate character, so one can only come from a ``\\uD800``-``\\uDFFF`` escape: only then is
    `value` walked (an escaped pair is fine: it decodes to one character)."""
    if b"\\" not in raw or _SURROGATE_ESCAPE.search(raw) is None:
        return
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                code = f"\\u{ord(found.group(0)):04x}"
                raise JsonNotText(
                    f"the JSON document holds a lone surrogate ({code}) in a string, which is not Unicode text",
                    f"The surrogate {code} in string is invalid.",
                )
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
