"""An incremental JSON reader: text goes in piece by piece (as tokens are generated), and it reports
where each value begins and ends (by its path from the root and its offset in the text) and the
decoded characters of string values as soon as they are known. It does no more than the tool-call
reader needs; it stops at the first character that cannot continue a JSON text (`failed`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Path = tuple[str | int, ...]
Kind = Literal["object", "array", "string", "scalar"]
WHITESPACE = " \t\n\r"
SCALAR_CHARS = set("0123456789+-.eEtrufalsn")
ESCAPES = set('"\\/bfnrtu')
HEX = set("0123456789abcdefABCDEF")


@dataclass
class _Frame:
    kind: Literal["object", "array"]
    path: Path
    expect: str  # object: key_or_end, key, colon, value, comma_or_end; array: value_or_end, value, comma_or_end
    key: str = ""
    count: int = 0


class JsonScanner:
    """Reads one JSON value. Callbacks: ``on_begin(path, kind, offset)``, ``on_end(path, kind, end)``
    (`end` is the offset just past the value), ``on_chars(path, decoded)`` for string values."""

    def __init__(
        self,
        on_begin: Callable[[Path, Kind, int], None],
        on_end: Callable[[Path, Kind, int], None],
        on_chars: Callable[[Path, str], None],
    ):
        self.on_begin, self.on_end, self.on_chars = on_begin, on_end, on_chars
        self.stack: list[_Frame] = []
        self.pos = 0  # offset of the next character
        self.started = self.done = self.failed = False
        self._string: list[str] | None = None  # raw characters of the open string (escapes kept)
        self._string_is_key = False
        self._string_path: Path = ()
        self._string_start = 0
        self._decoded = 0  # raw characters of the open string already decoded and reported
        self._escape = 0  # characters still expected by the open escape (0: none)
        self._scalar: list[str] | None = None
        self._scalar_path: Path = ()
        self._scalar_start = 0

    def feed(self, text: str) -> None:
        for ch in text:
            if self.failed:
                return
            self._char(ch)
            self.pos += 1
        if self._string is not None and not self._string_is_key:
            self._flush_string(final=False)

    # --- one character ------------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self._string is not None:
            self._string_char(ch)
            return
        if self._scalar is not None:
            if ch in SCALAR_CHARS:
                self._scalar.append(ch)
                return
            self._end_scalar()
            if self.failed:
                return
        if ch in WHITESPACE:
            return
        if self.done:
            self.failed = True  # text after the value
            return
        if not self.stack:
            self._value(ch, ())
            return
        frame = self.stack[-1]
        expect = frame.expect
        if frame.kind == "object":
            if expect in ("key_or_end", "key") and ch == '"':
                self._open_string(key=True, path=frame.path)
            elif expect in ("key_or_end", "comma_or_end") and ch == "}":
                self._close()
            elif expect == "colon" and ch == ":":
                frame.expect = "value"
            elif expect == "value":
                frame.expect = "comma_or_end"
                self._value(ch, (*frame.path, frame.key))
            elif expect == "comma_or_end" and ch == ",":
                frame.expect = "key"
            else:
                self.failed = True
        else:
            if expect in ("value_or_end", "comma_or_end") and ch == "]":
                self._close()
            elif expect in ("value_or_end", "value"):
                frame.expect = "comma_or_end"
                frame.count += 1
                self._value(ch, (*frame.path, frame.count - 1))
            elif expect == "comma_or_end" and ch == ",":
                frame.expect = "value"
            else:
                self.failed = True

    def _value(self, ch: str, path: Path) -> None:
        self.started = True
        if ch == "{":
            self.stack.append(_Frame("object", path, "key_or_end"))
            self.on_begin(path, "object", self.pos)
        elif ch == "[":
            self.stack.append(_Frame("array", path, "value_or_end"))
            self.on_begin(path, "array", self.pos)
        elif ch == '"':
            self.on_begin(path, "string", self.pos)
            self._open_string(key=False, path=path)
        elif ch in SCALAR_CHARS:
            self._scalar, self._scalar_path, self._scalar_start = [ch], path, self.pos
            self.on_begin(path, "scalar", self.pos)
        else:
            self.failed = True

    def _close(self) -> None:
        frame = self.stack.pop()
        self._ended(frame.path, frame.kind, self.pos + 1)

    def _ended(self, path: Path, kind: Kind, end: int) -> None:
        self.on_end(path, kind, end)
        if not self.stack:
            self.done = True

    def _end_scalar(self) -> None:
        assert self._scalar is not None
        text, self._scalar = "".join(self._scalar), None
        try:
            json.loads(text)
        except ValueError:
            self.failed = True
            return
        self._ended(self._scalar_path, "scalar", self.pos)

    def finish(self) -> None:
        """The text is complete: a number at the very end is complete too."""
        if self._scalar is not None and not self.failed:
            self._end_scalar()

    # --- strings ------------------------------------------------------------------------------------

    def _open_string(self, *, key: bool, path: Path) -> None:
        self._string, self._string_is_key, self._string_path = [], key, path
        self._string_start, self._decoded, self._escape = self.pos, 0, 0

    def _string_char(self, ch: str) -> None:
        assert self._string is not None
        raw = self._string
        if self._escape:
            if self._escape == 5 and ch not in ESCAPES:  # the character after the backslash
                self.failed = True
                return
            if self._escape < 5 and ch not in HEX:
                self.failed = True
                return
            self._escape = 4 if (self._escape == 5 and ch == "u") else (0 if self._escape == 5 else self._escape - 1)
            raw.append(ch)
            return
        if ch == "\\":
            self._escape = 5
            raw.append(ch)
            return
        if ch == '"':
            self._close_string()
            return
        if ord(ch) < 0x20:
            self.failed = True
            return
        raw.append(ch)

    def _close_string(self) -> None:
        assert self._string is not None
        if self._string_is_key:
            try:
                key = json.loads('"' + "".join(self._string) + '"')
            except ValueError:
                self.failed = True
                return
            self._string = None
            frame = self.stack[-1]
            frame.key, frame.expect = key, "colon"
            return
        self._flush_string(final=True)
        if self.failed:
            return
        self._string = None
        self._ended(self._string_path, "string", self.pos + 1)

    def _flush_string(self, *, final: bool) -> None:
        """Report the decoded characters of the open string value that are complete."""
        assert self._string is not None
        raw = self._string
        cut = len(raw) if final else _complete_prefix(raw, self._decoded)
        if cut <= self._decoded:
            return
        try:
            text = json.loads('"' + "".join(raw[self._decoded : cut]) + '"')
        except ValueError:
            self.failed = True
            return
        self._decoded = cut
        self.on_chars(self._string_path, text)


def _complete_prefix(raw: list[str], start: int) -> int:
    """The end of the longest prefix of a string body (`raw`, escapes kept) that does not stop inside an
    escape or between the two halves of a surrogate pair, scanning from `start` (a safe point)."""
    i, safe, n = start, start, len(raw)
    while i < n:
        if raw[i] != "\\":
            i += 1
            safe = i
            continue
        if i + 1 >= n:
            break
        if raw[i + 1] != "u":
            i += 2
            safe = i
            continue
        if i + 6 > n:
            break
        code = int("".join(raw[i + 2 : i + 6]), 16)
        if 0xD800 <= code <= 0xDBFF:  # a high surrogate: wait for its low half
            if i + 12 > n:
                break
            i += 12
        else:
            i += 6
        safe = i
    return safe
