"""The server's engine steps over a level, read from its ``/metrics`` before and after it: TGI's
``tgi_batch_forward_duration`` histogram, by method (lmiserve and TGI export it): how many steps carried
prompt tokens (``prefill``, a prompt joining the running rows) and how long they took, against the steps
of decode rows alone.

Why a bench reports it: on a GPU a decode-only step replays a CUDA graph, a step with prompt tokens runs
eagerly (several times slower: docs/engine.md), so a level whose requests keep arriving spends much of its
time in the steps with prompts. The share and the two means say how much, from the server's own counts.
A server without the histogram (vLLM) or whose ``/metrics`` does not answer: None.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lmiserve.bench.clients import Reached

__all__ = ["StepCounts", "level_steps", "read_steps"]

HISTOGRAM = "tgi_batch_forward_duration"
METHODS = ("prefill", "decode")

StepCounts = dict[str, tuple[float, float]]  # method -> (steps, seconds)


def read_steps(server: Reached, timeout: float = 10.0) -> StepCounts | None:
    """The server's steps and their seconds by method so far; None when it does not say."""
    parts = urlsplit(server.url)
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    try:
        response = httpx.get(f"{parts.scheme}://{parts.netloc}/metrics", headers=headers, timeout=timeout)
        if response.status_code != 200:
            return None
        text = response.text
        found: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name != HISTOGRAM:
                continue
            for sample in family.samples:
                method = sample.labels.get("method")
                if method in METHODS and sample.name in (f"{HISTOGRAM}_count", f"{HISTOGRAM}_sum"):
                    counts = found.setdefault(method, [0.0, 0.0])
                    counts[0 if sample.name.endswith("_count") else 1] += sample.value
    except (httpx.HTTPError, ValueError):
        return None
    return {method: (steps, seconds) for method, (steps, seconds) in found.items()} or None


def level_steps(before: StepCounts | None, after: StepCounts | None) -> dict[str, Any] | None:
    """What a level's steps were (`read_steps` before and after it; the level's warm-up requests among
    them): ``prefill_steps`` and ``decode_steps``, ``prefill_share`` of all steps, each kind's mean in ms
    and ``prefill_over_decode`` (the ratio of the means); None without both readings or without a step."""
    if before is None or after is None:
        return None
    delta = {}
    for method in METHODS:
        now, was = after.get(method, (0.0, 0.0)), before.get(method, (0.0, 0.0))
        delta[method] = (round(now[0] - was[0]), now[1] - was[1])
    total = delta["prefill"][0] + delta["decode"][0]
    if total <= 0:
        return None
    means = {m: round(1e3 * s / n, 3) if n > 0 else None for m, (n, s) in delta.items()}
    prefill, decode = means["prefill"], means["decode"]
    return {
        "prefill_steps": delta["prefill"][0],
        "decode_steps": delta["decode"][0],
        "prefill_share": round(delta["prefill"][0] / total, 3),
        "prefill_step_ms": prefill,
        "decode_step_ms": decode,
        "prefill_over_decode": round(prefill / decode, 3) if prefill and decode else None,
    }
