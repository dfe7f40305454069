"""Reasoning models: the ``<think>…</think>`` block of a chat answer split from the rest, for every chat
protocol (OpenAI's `reasoning_content`, Anthropic's `thinking` blocks); each protocol writes the two
parts its own way (`lmiserve.protocols.openai.reasoning`, `lmiserve.protocols.anthropic.encoders`).

The parser is configured by the settings `reasoning_parser`, `reasoning_start` and `reasoning_end`. A
preset (vLLM's `--reasoning-parser` names, `REASONING_PRESETS`) gives a family's markers: ``<think>`` /
``</think>`` (DeepSeek-R1, Qwen3, GLM-4.5, ...), ``[THINK]`` / ``[/THINK]`` (Magistral), Granite 3.2's
``Here is my thought process:`` / ``Here is my response:`` (``Here's`` read as well, as vLLM reads it),
gpt-oss's analysis channel (``<|channel|>analysis<|message|>`` … ``<|end|>``: what follows, the final
channel's header and answer, is the content, for the harmony tool parser `openai` to read; the markers are
special tokens, whose text reaches the splitter only when the request keeps special tokens in its output).
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

A thinking budget (`Reasoning.budget`: Anthropic's `thinking.budget_tokens`, OpenAI's `reasoning_effort`
through `effort_budget`) becomes the engine's `ThinkingBudget`: after that many tokens inside the block the
engine forces the family's closing text (`Markers.close`: the end marker; for gpt-oss also the final
channel's header), then the model answers (lmiserve/engine/text/thinking.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from lmiserve.config.settings import REASONING_PRESETS, Settings, parse_effort_budgets
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import ThinkingBudget

_BEFORE, _INSIDE, _AFTER = "before", "inside", "after"

# the other spellings of a preset's (start, end) markers that its family writes (vLLM's granite parser
# reads "Here's" too, seen from quantized Granite models)
OTHER_MARKERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "granite": (("Here's my thought process:",), ("Here's my response:",)),
}
# what a thinking budget forces to close a preset's block when more than its end marker: gpt-oss ends
# its analysis message and opens the final channel, where the answer goes
CLOSE: dict[str, str] = {
    "openai_gptoss": "<|end|><|start|>assistant<|channel|>final<|message|>",
}


@dataclass(frozen=True)
class Markers:
    start: str
    end: str
    other_starts: tuple[str, ...] = ()  # other spellings of the markers the model may write
    other_ends: tuple[str, ...] = ()
    close: str = ""  # what a thinking budget forces to close the block ("": the end marker)

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.other_starts) if self.start else ()

    @property
    def ends(self) -> tuple[str, ...]:
        return (self.end, *self.other_ends)


def markers(settings: Settings) -> Markers | None:
    """The configured markers: the preset's, each overridden by `reasoning_start` / `reasoning_end`;
    None when no reasoning parser is configured."""
    name = settings.reasoning_parser or ""
    preset = REASONING_PRESETS.get(name)
    others = OTHER_MARKERS.get(name, ((), ()))
    start = settings.reasoning_start or (preset[0] if preset else "")
    end = settings.reasoning_end or (preset[1] if preset else "")
    if not end:
        return None
    return Markers(
        start,
        end,
        other_starts=() if settings.reasoning_start else others[0],
        other_ends=() if settings.reasoning_end else others[1],
        close="" if settings.reasoning_end else CLOSE.get(name, ""),
    )


def opened_in(prompt: str, marks: Markers) -> bool:
    """Whether the output starts inside the block: the prompt ends inside an open one (the template
    opened it for the model), or there is no start marker (only an end marker is configured)."""
    if not marks.start:
        return True
    return max(prompt.rfind(s) for s in marks.starts) > max(prompt.rfind(e) for e in marks.ends)


def reads_effort(chat_template: object) -> bool:
    """Whether a chat template (the tokenizer's `chat_template`: a text, or named texts) reads the
    `reasoning_effort` variable itself (gpt-oss's writes ``Reasoning: low`` into its system message)."""
    if isinstance(chat_template, dict):
        return any(reads_effort(text) for text in chat_template.values())
    return isinstance(chat_template, str) and "reasoning_effort" in chat_template


def effort_budget(settings: Settings, effort: str | None, chat_template: object) -> int | None:
    """The thinking budget of OpenAI's `reasoning_effort` (None: no bound): ``none`` is 0 (thinking off);
    another effort is the `reasoning_effort_budgets` setting's, unless the chat template reads
    `reasoning_effort` itself (the model then thinks as its template asks)."""
    if effort is None:
        return None
    if effort == "none":
        return 0
    if reads_effort(chat_template):
        return None
    return parse_effort_budgets(settings.reasoning_effort_budgets).get(effort)


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _first(text: str, marks: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of `marks` in `text` starts (the longest of those starting there), and which;
    -1 when none is there."""
    found = [(at, -len(m), m) for m in marks if (at := text.find(m)) >= 0]
    if not found:
        return -1, ""
    at, _, mark = min(found)
    return at, mark


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
        starts, ends = self.marks.starts, self.marks.ends
        while buf:
            if self.state == _BEFORE:
                stripped = buf.lstrip()
                start = next((s for s in starts if stripped.startswith(s)), None)
                if start is not None:
                    buf, self.state, self.block = stripped[len(start) :], _INSIDE, True
                    continue
                if any(s.startswith(stripped) for s in starts):  # only whitespace and maybe a marker's start
                    self.held = buf
                    break
                self.state = _AFTER
            elif self.state == _INSIDE:
                at, end = _first(buf, ends)
                if at >= 0:
                    reasoning += buf[:at]
                    buf, self.state, self.strip = buf[at + len(end) :], _AFTER, True
                    continue
                keep = max(_partial(buf, e) for e in ends)
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

    def sampling(self, grammar: Grammar | None, tokens: int | None, *, keep_special: bool) -> dict[str, Any]:
        """What the block asks of one request's generation, as `SamplingParams` fields: its `grammar` after
        the block, its budget of `tokens` (None: none), and the text of special tokens kept when a marker
        is one (`keep_special`: gpt-oss's channels, Magistral's ``[THINK]``), so the block can be read."""
        fields: dict[str, Any] = {"grammar": self.grammar(grammar), "thinking": self.budget(tokens)}
        if keep_special:
            fields["skip_special_tokens"] = False
        return fields

    def budget(self, tokens: int | None) -> ThinkingBudget | None:
        """The engine's bound on this block: `tokens` generated inside it, then its closing text forced
        (None: no bound)."""
        if tokens is None:
            return None
        return ThinkingBudget(
            tokens=tokens,
            close=self.marks.close or self.marks.end,
            ends=self.marks.ends,
            starts=self.marks.starts,
            inside=self.inside,
        )


R = TypeVar("R", bound=Reasoning)


@dataclass(frozen=True)
class Thinking(Generic[R]):
    """A configured reasoning parser as a chat request's parse step applies it, once the prompt is rendered
    (where the block starts depends on it): `kind`, the `Reasoning` that reads the answer (a protocol's
    own); the settings and chat template a `reasoning_effort` budget depends on; `keep_special`: a marker
    is a special token (the output keeps special tokens' text)."""

    kind: type[R]
    settings: Settings
    template: object
    keep_special: bool

    @classmethod
    def of(cls, kind: type[R], settings: Settings, tokenizer: Any) -> Thinking[R] | None:
        """None when no reasoning parser is configured."""
        marks = markers(settings)
        if marks is None:
            return None
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        special = [str(t) for t in decoder.values() if getattr(t, "special", False) and str(t)]
        keep = any(token in marker for token in special for marker in (*marks.starts, *marks.ends))
        return cls(kind, settings, getattr(tokenizer, "chat_template", None), keep)

    def reasoning(self, prompt: str) -> R:
        """The parser of the answer to `prompt` (the rendered prompt tells whether it starts inside the block)."""
        marks = markers(self.settings)
        assert marks is not None  # `of` made this only with a parser configured
        return self.kind(marks, opened_in(prompt, marks))

    def effort_budget(self, effort: str | None) -> int | None:
        """The budget of OpenAI's `reasoning_effort` (`effort_budget`)."""
        return effort_budget(self.settings, effort, self.template)

    def sampling(self, reasoning: Reasoning, grammar: Grammar | None, tokens: int | None) -> dict[str, Any]:
        """`Reasoning.sampling` for this model."""
        return reasoning.sampling(grammar, tokens, keep_special=self.keep_special)
