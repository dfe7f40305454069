"""Reading a tool-calling answer (the text generated under `schema.output_schema`) as it is generated.

`ToolOutput.feed(text)` returns what became known: `Content` (plain answer text, decoded from
``{"content": "..."}``), `CallStart` (a call's index and name) and `Arguments` (a piece of a call's
arguments: the raw JSON text of its ``parameters`` value, so the pieces concatenate to the
arguments string). After the last piece, `calls` holds the complete calls only and `content` the
plain answer (None when the answer is calls).

An answer that is not the expected JSON (possible only if the output was not constrained) is plain
text: when it does not start with ``{`` or ``[``, all of it is the content; when it stops making sense
later, what came after is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from lmiserve.protocols.textgen.tools.json_scan import WHITESPACE, JsonScanner, Kind, Path


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Piece = Content | CallStart | Arguments


@dataclass
class Call:
    """One call as it is read: `arguments` is set once the whole ``parameters`` value was read."""

    index: int
    name: str | None = None
    start: int | None = None  # offset of the parameters value in the text
    end: int | None = None
    sent: int = 0  # offset up to which the arguments were reported
    closed: bool = False  # its object ended
    arguments: str | None = None

    @property
    def complete(self) -> bool:
        return self.closed and self.name is not None and self.arguments is not None


class ToolOutput:
    """One generated answer (one choice)."""

    def __init__(self) -> None:
        self.text = ""
        self.mode: Literal["pending", "text", "content", "calls"] = "pending"
        self._content: list[str] = []
        self._calls: dict[Path, Call] = {}
        self._pieces: list[Piece] = []
        self._starts: dict[Path, int] = {}
        self._fed = 0  # characters of `text` the scanner read
        self._scanner = JsonScanner(self._begin, self._end, self._chars)

    # --- results ------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The whole JSON answer was read (a plain-text answer is never done)."""
        return self._scanner.done and not self._scanner.failed

    @property
    def calls(self) -> list[Call]:
        """The complete calls, in order."""
        return [c for c in self._calls.values() if c.complete]

    @property
    def content(self) -> str | None:
        """The plain answer; None when the answer is calls."""
        if self.mode in ("pending", "text"):
            return self.text
        if self.mode == "content":
            return "".join(self._content)
        if not self.calls and (self._scanner.failed or self._scanner.done):
            return self.text  # JSON that is not calls (a free ``auto`` answer): text, as written
        return None

    # --- reading ------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        if self.mode == "text":
            return [Content(text)] if text else []
        if self._fed == 0:
            stripped = self.text.lstrip(WHITESPACE)
            if not stripped:
                return []
            if stripped[0] not in "{[":
                self.mode = "text"
                return [Content(self.text)]
        # the scanner reads the whole text from its first character (its offsets are the text's)
        self._scanner.feed(self.text[self._fed :])
        self._fed = len(self.text)
        self._report_arguments()
        pieces, self._pieces = self._pieces, []
        return pieces

    def finish(self) -> list[Piece]:
        """The text is complete."""
        self._scanner.finish()
        self._report_arguments()
        pieces, self._pieces = self._pieces, []
        return pieces

    # --- the scanner's callbacks --------------------------------------------------------------------

    def _context(self, path: Path) -> tuple[Path, str] | None:
        """(call path, key) when `path` is a key of a call object, else None."""
        if not path or not isinstance(path[-1], str):
            return None
        call_path = path[:-1]
        if self.mode == "calls" and len(call_path) == 1 and isinstance(call_path[0], int):
            return call_path, path[-1]  # [ {...}, {...} ]
        if not call_path:
            return call_path, path[-1]  # one object
        return None

    def _call(self, path: Path) -> Call:
        if path not in self._calls:
            self._calls[path] = Call(len(self._calls))
        return self._calls[path]

    def _begin(self, path: Path, kind: Kind, offset: int) -> None:
        self._starts[path] = offset
        if path == ():
            self.mode = "calls" if kind == "array" else "pending"
            return
        found = self._context(path)
        if found is None:
            return
        call_path, key = found
        if call_path == () and self.mode == "pending":
            self.mode = "content" if key == "content" else "calls"
        if self.mode == "calls" and key == "parameters":
            self._call(call_path).start = offset
            self._call(call_path).sent = offset

    def _end(self, path: Path, kind: Kind, end: int) -> None:
        if self.mode != "calls":
            return
        if path in self._calls and kind == "object":
            self._calls[path].closed = True
            return
        found = self._context(path)
        if found is None:
            return
        call_path, key = found
        call = self._call(call_path)
        if key == "name" and kind == "string":
            call.name = json.loads(self.text[self._starts[path] : end])
            self._pieces.append(CallStart(call.index, call.name))
            self._report(call)
        elif key == "parameters" and call.start is not None:
            call.end = end
            call.arguments = self.text[call.start : end]
            self._report(call)

    def _chars(self, path: Path, text: str) -> None:
        if self.mode == "content" and path == ("content",):
            self._content.append(text)
            self._pieces.append(Content(text))

    def _report_arguments(self) -> None:
        """The arguments read so far of the call being read (in the order of the text)."""
        if not self._scanner.failed:
            for call in self._calls.values():
                self._report(call)

    def _report(self, call: Call) -> None:
        if call.name is None or call.start is None:
            return  # the name first
        upto = call.end if call.end is not None else self._scanner.pos
        if upto > call.sent:
            self._pieces.append(Arguments(call.index, self.text[call.sent : upto]))
            call.sent = upto
