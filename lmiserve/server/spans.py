"""What a span carries, as `server/tracing.py` makes it and `server/otlp.py` (the only module that imports
OpenTelemetry) exports it: plain values, so neither module needs the other's."""

from __future__ import annotations

from dataclasses import dataclass

AttributeValue = str | bool | int | float | list[str]


@dataclass(frozen=True)
class Phase:
    """A child span: one phase of the request in the engine (times are `time.monotonic()`)."""

    name: str  # "queue", "prefill" or "decode"
    start: float
    end: float
    attributes: dict[str, AttributeValue]
