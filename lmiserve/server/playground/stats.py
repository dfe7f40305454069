"""The live state of the served LLMs for the playground's batch panel, as a server-sent event stream.

Each event is one JSON object, ``{"models": [...]}``, one entry per LLM: its status, the running and
waiting sequences, the batch's slots, the KV cache in use, the tokens it generated per second over
the last few seconds, and whether it takes images (``vision``: a vision-language model, with the
server's ``max_image_bytes`` and ``max_images``; the page offers to attach an image only then). It is
read from the engines' neutral snapshot (`lmiserve.core.stats`), the same one the Prometheus gauges
read; the engines know nothing of this stream.

A stream ends by itself after `STREAM_SECONDS` (the page reconnects at once), so an open browser tab
never keeps a stopping server waiting for its connection to close for longer than that.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from lmiserve.core.errors import LmiServeError
from lmiserve.models.service import ModelService
from lmiserve.server.sse import event

INTERVAL = 0.5  # seconds between two events (~2 updates/s)
STREAM_SECONDS = 10.0  # a stream's life; the page reconnects when it ends
RATE_WINDOW = 2.0  # seconds of history the tokens/s figure averages over


class TokenRate:
    """Tokens per second from a cumulative count, over the last `window` seconds, per model. Shared by
    every stream of an app, so a reconnecting page keeps its history."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def rate(self, name: str, now: float, total: int) -> float:
        samples = self._samples.setdefault(name, deque())
        if samples and total < samples[-1][1]:  # a new engine (the model was reloaded): start over
            samples.clear()
        samples.append((now, total))
        while len(samples) > 2 and samples[1][0] <= now - self.window:
            samples.popleft()  # keep one sample at or before the window's start as the baseline
        start, first = samples[0]
        return (total - first) / (now - start) if now > start else 0.0


def model_stats(service: ModelService, rates: TokenRate, now: float) -> dict[str, Any]:
    """One LLM's entry of an event."""
    entry: dict[str, Any] = {"name": service.name, "status": service.status.lower()}
    try:
        engine = service.ready_generator()
    except LmiServeError:  # loading or failed: the status says which
        return entry
    snap = engine.snapshot()
    entry.update(
        running=snap.running,
        waiting=snap.waiting,
        batch_slots=snap.batch_slots,
        kv_tokens=snap.kv_tokens,
        kv_capacity=snap.kv_capacity,
        kv_usage=round(snap.kv_usage, 6),
        kv_blocks=snap.kv_blocks,
        kv_block_size=snap.kv_block_size,
        preemptions=snap.preemptions,
        generated_tokens=snap.generated_tokens,
        prefix_cache_tokens=snap.prefix_cache_tokens,
        prefix_cache_capacity=snap.prefix_cache_capacity,
        tokens_per_second=round(rates.rate(service.name, now, snap.generated_tokens), 1),
        vision=service.ready_llm().processor is not None,
    )
    if entry["vision"]:
        entry["max_image_bytes"] = int(service.settings.max_image_bytes)
        entry["max_images"] = int(service.settings.limit_mm_per_prompt)
    if snap.speculation is not None:
        spec = snap.speculation
        entry["speculation"] = {
            key: spec[key] for key in ("method", "active", "reason", "acceptance_rate", "mean_accepted_length")
        }
    return entry


def snapshot(models: Iterable[ModelService], rates: TokenRate, now: float | None = None) -> dict[str, Any]:
    """One event's object: every LLM among `models`."""
    now = time.monotonic() if now is None else now
    return {"models": [model_stats(s, rates, now) for s in models if s.is_llm]}


async def events(
    models: Callable[[], Iterable[ModelService]],
    rates: TokenRate,
    *,
    interval: float = INTERVAL,
    lifetime: float = STREAM_SECONDS,
) -> AsyncIterator[bytes]:
    """The stream's events: one now, then one every `interval` seconds until `lifetime` is over."""
    end = time.monotonic() + lifetime
    while True:
        body = json.dumps(snapshot(models(), rates), separators=(",", ":"))
        yield event(body.encode("utf-8"))
        if time.monotonic() + interval > end:
            return
        await asyncio.sleep(interval)
