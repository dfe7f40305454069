"""What the families that mark their calls in the text share: finding the marked blocks among plain text
(`read_blocks`), and reading a call written as JSON (`read_json`) with its arguments as the raw JSON
text the model wrote, so that the streamed pieces concatenate to the final arguments string.

A block is what follows a family's marker (``<tool_call>``, ``[TOOL_CALLS]``, ...): its reader says
which calls it holds and where it ends (`Block`), that it is still open (``end`` None: everything after
the marker belongs to it so far), or that it is not a call at all (None: the marker is plain text).
The text outside blocks is the content; between and after calls, text that is only whitespace is
dropped (the newlines models put between calls).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lmiserve.protocols.textgen.tools.functions import ToolChoice
from lmiserve.protocols.textgen.tools.json_scan import WHITESPACE, JsonScanner, Kind, Path
from lmiserve.protocols.textgen.tools.parsers.base import Parsed, PartialCall, held_back, lark_json
from lmiserve.protocols.textgen.tools.schema import MAX_PARALLEL_CALLS

ARGUMENT_KEYS = ("arguments", "parameters")
OPTIONAL_WS = r"/[ \t\r\n]*/"  # a Lark expression: optional whitespace
Shape = Literal["object", "array", "arguments"]


def skip_ws(text: str, pos: int) -> int:
    """The offset of the first character at or after `pos` that is not whitespace (`len(text)` if none)."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


# --- blocks among plain text ------------------------------------------------------------------------


@dataclass
class Block:
    """The calls one marked block holds; `end` the offset just past it, None while it is still open."""

    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None


# (text, offset just past the marker, the marker, final) -> the block, or None: the marker is plain text
ReadBlock = Callable[[str, int, str, bool], Block | None]


def read_blocks(text: str, *, final: bool, markers: Sequence[str], read_block: ReadBlock) -> Parsed:
    """`text` as content and the calls of the blocks that start at one of `markers`."""
    content: list[str] = []
    calls: list[PartialCall] = []
    segment = search = 0  # start of the text not yet read as content; where to look for a marker
    after_call = False
    while True:
        at, marker = _first(text, markers, search)
        if at < 0:
            tail = text[segment:]
            if not final:
                tail = tail[: len(tail) - held_back(tail, markers)]
            _content(content, tail, after_call)
            break
        block = read_block(text, at + len(marker), marker, final)
        if block is None:  # not a call: the marker is text
            search = at + len(marker)
            continue
        _content(content, text[segment:at], after_call)
        calls.extend(block.calls)
        if block.end is None:
            break
        segment = search = block.end
        after_call = True
    return Parsed("".join(content), calls)


def _first(text: str, markers: Sequence[str], start: int) -> tuple[int, str]:
    best, found = -1, ""
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, marker
    return best, found


def _content(content: list[str], text: str, after_call: bool) -> None:
    if text and not (after_call and not text.strip(WHITESPACE)):
        content.append(text)


def closing(text: str, end: int, close: str, calls: list[PartialCall], final: bool) -> Block:
    """The block of `calls` read up to `end`, which the family closes with `close` (optional whitespace
    first). Until the closing marker is read the calls are not complete; text that is neither whitespace
    nor the marker ends the block where the calls ended (a forgotten marker); at the end of the output
    the calls are complete without it."""
    after = skip_ws(text, end)
    rest = text[after:]
    if rest.startswith(close):
        return Block(_completed(calls), after + len(close))
    if close.startswith(rest):  # nothing yet, or a part of the marker
        return Block(_completed(calls), len(text)) if final else Block(calls, None)
    return Block(_completed(calls), end)


def _completed(calls: list[PartialCall]) -> list[PartialCall]:
    return [PartialCall(c.name, c.arguments, complete=True) for c in calls]


# --- calls written as JSON --------------------------------------------------------------------------


@dataclass
class _Call:
    name: str | None = None
    name_path: Path | None = None
    name_start: int = 0
    arguments_path: Path | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    closed: bool = False


@dataclass(frozen=True)
class JsonCalls:
    """What `read_json` read of the JSON value that starts at `start` in `text` (see there)."""

    text: str
    start: int
    shape: Shape
    calls_read: tuple[tuple[str | None, int | None, int | None, bool], ...]  # name, arguments span, closed
    end: int | None  # offset just past the value, once complete
    failed: bool  # not JSON
    bad: bool  # JSON so far, but not calls (a call that is not an object, a name not a string...)
    pos: int  # where reading stopped (the end of the text, or the character that is not JSON)
    scalar: int | None  # start of the number or literal being read

    @property
    def valid(self) -> bool:
        """The whole value was read and it is one or more complete calls."""
        return (
            self.end is not None
            and not self.bad
            and bool(self.calls_read)
            and all(
                (self.shape == "arguments" or name is not None) and closed and end is not None
                for name, _, end, closed in self.calls_read
            )
        )

    @property
    def broken(self) -> bool:
        """No text that follows can make it calls."""
        return self.failed or self.bad or (self.end is not None and not self.valid)

    @property
    def named(self) -> bool:
        """A call's name was read (so a reader may have reported the call)."""
        return any(name is not None for name, _, _, _ in self.calls_read)

    @property
    def resume(self) -> int:
        """Where the text after what was read begins."""
        return self.end if self.end is not None else self.pos

    def calls(self, *, complete: bool) -> list[PartialCall]:
        """The calls, their arguments the raw text of their arguments objects: all of it once complete,
        before that the part read so far, less a number or literal still being written."""
        upto = self.pos if self.scalar is None else min(self.pos, self.scalar)
        return [
            PartialCall(name, "" if start is None else self.text[start : upto if end is None else end], complete)
            for name, start, end, _ in self.calls_read
        ]


def read_json(text: str, start: int, shape: Shape, argument_keys: Sequence[str] = ARGUMENT_KEYS) -> JsonCalls:
    """The JSON value that starts at `start` in `text` (its first character, ``{`` or ``[``) read as
    calls. `shape`:

    - ``object``: one call, ``{"name": ..., "arguments": {...}}`` (any of `argument_keys`; other keys
      are ignored, the first of a repeated key counts);
    - ``array``: a JSON array of such calls;
    - ``arguments``: the arguments object alone (the family writes the name outside the JSON).

    A stream's snapshots grow, so the reading of the last shorter text that this one extends is resumed
    (a few hundred readings are kept): each token costs the characters it adds, not the whole text.
    """
    keys = tuple(argument_keys)
    with _lock:
        reader = None
        for key, kept in reversed(_readers.items()):
            if (kept.start, kept.shape, kept.argument_keys) == (start, shape, keys) and text.startswith(kept.text):
                reader = _readers.pop(key)
                break
        if reader is None:
            reader = _JsonReader(start, shape, keys)
        reader.read(text)
        _readers[id(reader)] = reader
        while len(_readers) > _KEPT:
            _readers.popitem(last=False)
        return reader.result()


_KEPT = 256
_readers: OrderedDict[int, _JsonReader] = OrderedDict()
_lock = threading.Lock()


class _JsonReader:
    """The reading of one JSON value, resumed as its text grows (`read_json`)."""

    def __init__(self, start: int, shape: Shape, argument_keys: tuple[str, ...]):
        self.start, self.shape, self.argument_keys = start, shape, argument_keys
        self.text = ""
        self.calls: dict[Path, _Call] = {}
        self.end: int | None = None
        self.bad = False
        self.scalar: int | None = None
        self.scanner = JsonScanner(self._begin, self._end, _ignore)

    def read(self, text: str) -> None:
        """Read `text`, which extends the text read so far."""
        fed = max(len(self.text), self.start)
        self.text = text
        self.scanner.feed(text[fed:])

    def result(self) -> JsonCalls:
        failed = self.scanner.failed and self.end is None
        calls = tuple((c.name, c.arguments_start, c.arguments_end, c.closed) for c in self.calls.values())
        pos = self.start + self.scanner.pos - (1 if failed else 0)
        return JsonCalls(self.text, self.start, self.shape, calls, self.end, failed, self.bad, pos, self.scalar)

    # --- the scanner's callbacks --------------------------------------------------------------------

    def _begin(self, path: Path, kind: Kind, offset: int) -> None:
        offset += self.start
        if kind == "scalar":
            self.scalar = offset
        if path == ():
            wanted = "array" if self.shape == "array" else "object"
            if kind != wanted:
                self.bad = True
            elif self.shape == "object":
                self.calls[()] = _Call()
            elif self.shape == "arguments":
                self.calls[()] = _Call(arguments_path=(), arguments_start=offset)
            return
        if self.shape == "array" and len(path) == 1:  # an element of the array
            if kind != "object":
                self.bad = True
            else:
                self.calls[path] = _Call()
            return
        call = self.calls.get(path[:-1])
        key = path[-1]
        if call is None or not isinstance(key, str) or self.shape == "arguments":
            return
        if key == "name" and call.name_path is None:
            call.name_path, call.name_start = path, offset
            if kind != "string":
                self.bad = True
        elif key in self.argument_keys and call.arguments_path is None:
            call.arguments_path, call.arguments_start = path, offset
            if kind != "object":
                self.bad = True

    def _end(self, path: Path, kind: Kind, end: int) -> None:
        end += self.start
        if kind == "scalar":
            self.scalar = None
        if path == ():
            self.end = end
        if path in self.calls:
            self.calls[path].closed = True
        if self.shape == "arguments":
            if path == ():
                self.calls[()].arguments_end = end
            return
        call = self.calls.get(path[:-1]) if path else None
        if call is None:
            return
        if path == call.name_path and kind == "string":
            call.name = json.loads(self.text[call.name_start : end])
        elif path == call.arguments_path:
            call.arguments_end = end


def _ignore(path: Path, text: str) -> None:
    pass


def json_block(scan: JsonCalls, final: bool, close: str | None = None) -> Block | None:
    """The block of a family that writes its calls as one JSON value after its marker (then `close`, if
    it has a closing marker). A value that cannot be calls is plain text, unless a call's name was read
    already (it may have been reported): until the end of the output that block stays open, with
    nothing more to say, up to its closing marker."""
    text = scan.text
    if scan.valid:
        assert scan.end is not None
        calls = scan.calls(complete=close is None)
        return closing(text, scan.end, close, calls, final) if close is not None else Block(calls, scan.end)
    if final or (scan.broken and not scan.named):
        return None
    if scan.broken and close is not None:
        at = text.find(close, scan.resume)
        return Block(scan.calls(complete=False), at + len(close) if at >= 0 else None)
    return Block(scan.calls(complete=False), None)


def array_grammar(calls: Sequence[dict[str, Any]], spec: ToolChoice) -> str:
    """A Lark expression for a JSON array of calls valid under one of `calls` (schemas): 1 to
    `MAX_PARALLEL_CALLS` of them when `spec` allows several, else exactly one."""
    several = spec.parallel and spec.mode != "named"
    items = calls[0] if len(calls) == 1 else {"anyOf": list(calls)}
    return lark_json({"type": "array", "items": items, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if several else 1})
