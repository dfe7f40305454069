"""A reader for Java-properties files such as DJL Serving's ``serving.properties``.

Supported syntax (the subset of ``java.util.Properties.load`` that configuration files use):

- ``key=value``, ``key: value`` and ``key value``; whitespace around key and separator is ignored;
- ``#`` and ``!`` comment lines and blank lines;
- a line ending in an odd number of backslashes continues on the next line, whose leading
  whitespace is dropped;
- escapes ``\\t \\n \\r \\f \\uXXXX`` and ``\\<char>`` (e.g. ``\\=`` or ``\\:`` inside a key);
- keys are case-sensitive and a later duplicate wins.

Unlike Java, trailing whitespace of a value is removed (``option.tgi_compat=true `` is ``true``).
Keys are returned without their ``option.`` prefix: ``option.max_rolling_batch_size`` and
``max_rolling_batch_size`` are the same key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from lmiserve.config.errors import ConfigError

OPTION_PREFIX = "option."

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_WHITESPACE = " \t\f"
_SEPARATORS = "=:"
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def strip_option_prefix(key: str) -> str:
    """``option.max_rolling_batch_size`` -> ``max_rolling_batch_size``; other keys unchanged."""
    return key.removeprefix(OPTION_PREFIX)


def parse_properties(text: str) -> dict[str, str]:
    """Parse Java-properties text into ``{bare key: value}`` (see the module docstring)."""
    result: dict[str, str] = {}
    for line in _logical_lines(text.removeprefix("\ufeff")):
        key, value = _split_entry(line)
        result[strip_option_prefix(key)] = value
    return result


def read_properties(path: str | Path) -> dict[str, str]:
    """Read and parse a properties file (UTF-8, falling back to ISO-8859-1 like Java)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read properties file '{file}': {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return parse_properties(text)


def _logical_lines(text: str) -> Iterator[str]:
    """Yield logical lines: comments and blank lines dropped, continuations joined."""
    pending: str | None = None
    for natural in _LINE_BREAK.split(text):
        stripped = natural.lstrip(_WHITESPACE)
        if pending is None:
            if not stripped or stripped[0] in "#!":
                continue
            pending = ""
        if _ends_with_continuation(stripped):
            pending += stripped[:-1]
            continue
        yield pending + stripped
        pending = None
    if pending:  # the file ended inside a continuation
        yield pending


def _ends_with_continuation(line: str) -> bool:
    trailing = len(line) - len(line.rstrip("\\"))
    return trailing % 2 == 1


def _split_entry(line: str) -> tuple[str, str]:
    """Split one logical line into its (unescaped) key and value."""
    i, n = 0, len(line)
    while i < n and line[i] not in _WHITESPACE and line[i] not in _SEPARATORS:
        i += 2 if line[i] == "\\" else 1
    key_end = min(i, n)
    while i < n and line[i] in _WHITESPACE:
        i += 1
    if i < n and line[i] in _SEPARATORS:
        i += 1
        while i < n and line[i] in _WHITESPACE:
            i += 1
    return _unescape(line[:key_end]), _unescape(line[i:]).rstrip(_WHITESPACE)


def _unescape(raw: str) -> str:
    if "\\" not in raw:
        return raw
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        char = raw[i]
        if char != "\\" or i + 1 >= n:
            out.append(char)
            i += 1
            continue
        nxt = raw[i + 1]
        if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", raw[i + 2 : i + 6]):
            out.append(chr(int(raw[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
    return "".join(out)
