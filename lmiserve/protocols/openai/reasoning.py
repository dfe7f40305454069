"""Reasoning models on the chat route: the ``<think>…</think>`` block split from the answer.

With a reasoning parser configured (settings `reasoning_parser`, `reasoning_start`, `reasoning_end`), a
chat answer's reasoning block goes to ``message.reasoning_content`` and ``message.reasoning`` (both
spellings are in use: vLLM's older and newer), the rest to ``content``; streamed, the block's text comes
as ``delta.reasoning_content`` / ``delta.reasoning`` and the answer after it as ``delta.content``.
``usage.completion_tokens_details.reasoning_tokens`` counts the tokens generated inside the block (those
after the start marker up to the one that completes the end marker).

Where the block starts, how markers split across tokens are read and where a grammar starts: the neutral
splitter, `lmiserve.protocols.textgen.reasoning`; a block never closed is all reasoning (``content``
null).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmiserve.protocols.textgen import reasoning as neutral
from lmiserve.protocols.textgen.reasoning import Markers, Splitter, markers, opened_in
from lmiserve.protocols.textgen.sequences import GeneratedSequence

__all__ = ["Markers", "Reasoning", "Splitter", "markers", "opened_in"]


@dataclass(frozen=True)
class Reasoning(neutral.Reasoning):
    """The neutral parser (`lmiserve.protocols.textgen.reasoning`) with OpenAI's message and delta fields."""

    def answer(self, inner: Any) -> Any:
        """A `chat_encoders.Answer` whose message gets the reasoning and whose `inner` answer reads the content."""

        def answer(seq: GeneratedSequence) -> tuple[dict[str, Any], str]:
            reasoning, content = self.split(seq.finish.generated_text)
            finish = dataclasses.replace(seq.finish, generated_text=content or "")
            message, reason = inner(GeneratedSequence(seq.tokens, seq.top_tokens, finish))
            if message.get("content") == "" and content is None:
                message["content"] = None
            message["reasoning_content"] = message["reasoning"] = reasoning
            return message, reason

        return answer

    def delta(self, splitter: Splitter, text: str | None, final: bool) -> dict[str, Any]:
        """A stream chunk's delta fields for one token's text (`final`: the choice's last token)."""
        reasoning, content = splitter.token(text) if text is not None else ("", "")
        if final:
            r, c = splitter.flush()
            reasoning, content = reasoning + r, content + c
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content or not reasoning:
            delta["content"] = content
        return delta
