"""TGI's timing headers of a whole (non-streamed) answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class Timer:
    """Validation, queue (until the first event, prefill included) and inference time of one request."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.validated = self.first = self.end = self.start

    def mark_validated(self) -> None:
        self.validated = self.first = time.monotonic()

    async def watch(self, events: AsyncIterator[T]) -> AsyncIterator[T]:
        """`events` unchanged, noting when the first came and when the stream ended."""
        seen = False
        try:
            async for event in events:
                if not seen:
                    seen, self.first = True, time.monotonic()
                yield event
        finally:
            self.end = time.monotonic()
            await events.aclose()  # type: ignore[attr-defined]

    def headers(self, compute_type: str, characters: int, prompt_tokens: int, generated: int) -> dict[str, str]:
        total, inference = self.end - self.start, self.end - self.first
        ms = lambda seconds: str(int(seconds * 1000))  # noqa: E731
        return {
            "x-compute-type": compute_type,
            "x-compute-time": repr(total),
            "x-compute-characters": str(characters),
            "x-total-time": ms(total),
            "x-validation-time": ms(self.validated - self.start),
            "x-queue-time": ms(self.first - self.validated),
            "x-inference-time": ms(inference),
            "x-time-per-token": ms(inference / generated if generated else 0.0),
            "x-prompt-tokens": str(prompt_tokens),
            "x-generated-tokens": str(generated),
        }
