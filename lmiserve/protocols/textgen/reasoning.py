"""Reasoning models: the ``<think>…</think>`` block of a chat answer split from the rest, for every chat
protocol (OpenAI's `reasoning_content`, Anthropic's `thinking` blocks); each protocol writes the two
parts its own way (`lmiserve.protocols.openai.reasoning`, `lmiserve.protocols.anthropic.encoders`).

The parser is configured by the settings `reasoning_parser`, `reasoning_start` and `reasoning_end`.
``tokens`` counts the tokens generated inside the block (those after the start marker up to the one
that completes the end marker).

Where the block starts: when the rendered prompt ends inside an open block (the template wrote the start
marker, as DeepSeek-R1's and Qwen3's thinking templates do), or only an end marker is configured, the
output starts in the reasoning; else the block is read only at the very start of the output (whitespace
before the start marker allowed), and an output that starts with anything else has no reasoning at all.
A block never closed is all reasoning. A marker split across tokens is held back until it is complete;
leading whitespace after the block is dropped from the content.

A JSON-schema or tool grammar starts after the end marker when the output starts in the reasoning
(`Grammar.after`: the engine applies the constraint from the token after the one completing the marker);
otherwise it applies from the first token, so the model does not think.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Self

from lmiserve.config.settings import REASONING_PRESETS, Settings
from lmiserve.core.grammar import Grammar

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"


@dataclass(frozen=True)
class Markers:
    start: str
    end: str


def markers(settings: Settings) -> Markers | None:
    """The configured markers: the preset's, each overridden by `reasoning_start` / `reasoning_end`;
    None when no reasoning parser is configured."""
    preset = REASONING_PRESETS.get(settings.reasoning_parser or "")
    start = settings.reasoning_start or (preset[0] if preset else "")
    end = settings.reasoning_end or (preset[1] if preset else "")
    return Markers(start, end) if end else None


def opened_in(prompt: str, marks: Markers) -> bool:
    """Whether the output starts inside the block: the prompt ends inside an open one (the template
    opened it for the model), or there is no start marker (only an end marker is configured)."""
    return not marks.start or prompt.rfind(marks.start) > prompt.rfind(marks.end)


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Splitter:
    """One choice's text, piece by piece, split into (reasoning, content)."""

    def __init__(self, marks: Markers, inside: bool):
        self.marks = marks
        self.state = _INSIDE if inside else (_BEFORE if marks.start else _AFTER)
        self.block = inside  # a block was opened
        self.held = ""  # text not yet known to be reasoning or content (a marker may be starting)
        self.strip = False  # drop whitespace at the start of the content after a block
        self.tokens = 0  # tokens fed while inside the block

    def token(self, text: str) -> tuple[str, str]:
        """`feed` one token's text, counting it when it was generated inside the block."""
        if self.state == _INSIDE:
            self.tokens += 1
        return self.feed(text)

    def feed(self, text: str) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        reasoning = content = ""
        while buf:
            if self.state == _BEFORE:
                stripped = buf.lstrip()
                if stripped.startswith(self.marks.start):
                    buf, self.state, self.block = stripped[len(self.marks.start) :], _INSIDE, True
                    continue
                if self.marks.start.startswith(stripped):  # only whitespace and maybe a marker's start
                    self.held = buf
                    break
                self.state = _AFTER
            elif self.state == _INSIDE:
                at = buf.find(self.marks.end)
                if at >= 0:
                    reasoning += buf[:at]
                    buf, self.state, self.strip = buf[at + len(self.marks.end) :], _AFTER, True
                    continue
                keep = _partial(buf, self.marks.end)
                reasoning, self.held = reasoning + buf[: len(buf) - keep], buf[len(buf) - keep :]
                break
            else:
                if self.strip:
                    buf = buf.lstrip()
                    self.strip = not buf
                content += buf
                break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == _INSIDE:
            return held, ""
        return "", held.lstrip() if self.strip else held


@dataclass(frozen=True)
class Reasoning:
    """A chat request's reasoning parser: its markers and whether the output starts inside the block."""

    marks: Markers
    inside: bool

    @classmethod
    def of(cls, settings: Settings, prompt: str) -> Self | None:
        marks = markers(settings)
        return None if marks is None else cls(marks, opened_in(prompt, marks))

    def splitter(self) -> Splitter:
        return Splitter(self.marks, self.inside)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content): reasoning None without a block, content None when empty
        after one."""
        s = self.splitter()
        r1, c1 = s.feed(text)
        r2, c2 = s.flush()
        content = c1 + c2
        return (r1 + r2 if s.block else None), (content or None if s.block else content)

    def tokens(self, texts: Iterable[str]) -> int:
        """The reasoning tokens among a sequence's tokens (their texts, in order)."""
        s = self.splitter()
        for text in texts:
            s.token(text)
        return s.tokens

    def grammar(self, grammar: Grammar | None) -> Grammar | None:
        """The constraint to start after the block when the output starts inside it."""
        if grammar is None or not self.inside:
            return grammar
        return dataclasses.replace(grammar, after=self.marks.end)
