"""What every OpenAI encoder of chat completions and completions shares (chat_encoders.py,
completion_encoders.py, tool_calls.py): the envelope every object starts with, ``usage``, the finish and
stop reasons, and the bases of a whole and of a streamed answer's encoder. Compact JSON, ``object``
first; ``id`` is ``chatcmpl-<32 hex>`` or ``cmpl-<32 hex>``, new for every response (`completion_id`)
and the same in every chunk of a stream.

Finish reasons are OpenAI's: ``"length"`` when ``max_tokens`` ended it, ``"stop"`` otherwise (EOS, a stop
string, a stop token id; ``"tool_calls"`` comes from tool_calls.py). Every choice carries vLLM's
``stop_reason`` after it: the stop string or stop token id that ended the sequence, else ``null``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from lmiserve.core.errors import IncompleteGeneration, LmiServeError
from lmiserve.core.events import Finish, FinishReason, StepEvent
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.textgen.wire import SSE_CONTENT_TYPE

__all__ = [
    "Envelope",
    "StreamEncoder",
    "WholeEncoder",
    "completion_id",
    "finish_reason",
    "stop_reason",
    "usage",
]


def finish_reason(finish: Finish) -> str:
    """OpenAI's finish reason: ``length`` or ``stop`` (TGI's ``eos_token`` and ``stop_sequence`` are both ``stop``)."""
    return "length" if finish.reason is FinishReason.LENGTH else "stop"


def stop_reason(finish: Finish | None) -> str | int | None:
    """vLLM's ``stop_reason``: the matched stop string or stop token id, else None (EOS, length, running)."""
    return finish.stop_reason if finish is not None else None


def completion_id(chat: bool) -> str:
    """A new unique id, as OpenAI spells them: ``chatcmpl-...`` for a chat completion, else ``cmpl-...``."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass
class Envelope:
    """The fields every OpenAI object starts with."""

    model: str
    system_fingerprint: str
    created: int = 0
    id: str = ""  # completion_id(...); one per response

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def head(self, obj: str) -> dict[str, Any]:
        return {
            "object": obj,
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


def usage(prompt: int, completion: int, cached: int, reasoning: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache supplied;
    ``completion_tokens_details.reasoning_tokens`` with a reasoning parser (openai.reasoning)."""
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return body


class WholeEncoder:
    """The base of a whole answer's encoder: collects the tagged events; after `close`, the counts of the
    timing headers."""

    content_type = "application/json"
    streaming = False

    def __init__(self) -> None:
        self.events: list[tuple[int, StepEvent]] = []
        self.prompt_tokens = self.generated_tokens = self.characters = 0

    def on_event(self, index: int, event: StepEvent) -> bytes:
        self.events.append((index, event))
        return b""

    def _require_finished(self, prompts: int) -> None:
        """`IncompleteGeneration` unless every prompt has a finished sequence."""
        if len({index for index, event in self.events if event.finish is not None}) < prompts:
            raise IncompleteGeneration("Incomplete generation")

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)


class StreamEncoder:
    """The base of a streamed answer's encoder: SSE, an error after the start in-band."""

    content_type = SSE_CONTENT_TYPE
    streaming = True

    def error(self, exc: LmiServeError) -> bytes:
        return RENDERER.in_band(exc)
