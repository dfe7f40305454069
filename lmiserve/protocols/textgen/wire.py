"""How TGI (and its OpenAI routes) write JSON and SSE responses."""

from __future__ import annotations

import json
from typing import Any

# The response headers of every TGI/OpenAI event stream (content type first).
SSE_CONTENT_TYPE = "text/event-stream"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def dumps(obj: Any) -> bytes:
    """Compact JSON as serde writes it: no spaces, raw UTF-8."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
