"""Server-sent events: framing and keep-alive comments.

Keep-alive: a ``:\\n\\n`` comment after `interval` seconds without a chunk (the timer restarts after
each chunk, so a stream that is producing never carries one). It is the response pipeline's
`Heartbeat`: one timer task per stream, so a busy stream pays nothing per event for it.
"""

from __future__ import annotations

from lmiserve.server.pipeline import Heartbeat

KEEPALIVE = b":\n\n"


def event(data: bytes) -> bytes:
    """One event of a single ``data:`` line (no ``event:`` or ``id:`` lines)."""
    return b"data: " + data + b"\n\n"


def keepalive(interval: float) -> Heartbeat:
    """Keep-alive comments after `interval` silent seconds."""
    return Heartbeat(interval, KEEPALIVE)
