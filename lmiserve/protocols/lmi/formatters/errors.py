"""LMI error bodies (reference lmi.md §6) and the rule for failures during generation.

Bodies
- `lmi_error_body`: ``{"error":"<msg>","code":424}``, compact, error first (§6.1, §6.2), sent with
  ``Content-Type: application/json``. LMI writes it with Gson, which also escapes ``'`` as
  ``\\u0027`` and ``= < > &``; we write the same JSON value with Python's compact separators and
  raw UTF-8, without those escapes (any JSON parser reads both back to the same string).
- `frontend_error_body`: front-end errors (§6.3), 2-space pretty JSON ``code, type, message``
  followed by ``"\\n"``.
- `dynamic_batch_error_body`: handler failure in rolling_batch=disable mode (§6.4),
  ``{"code": 424, "message": "invoke handler failure", "error": "<details>"}`` as printed there.

A sequence that ends with ``FinishReason.ERROR`` (see `is_error_finish`) is handled by the HTTP
layer, not rendered by the formatter:

    async for event in engine_events:
        if is_error_finish(event):
            msg = error_message(event)
            if nothing sent yet:   # always the case for non-streaming formatters
                respond 424, application/json, lmi_error_body(msg)
            else:                  # HTTP 200 already sent
                send formatter.error_tail(msg) and end the stream
            break
        send formatter.on_event(event)
    send formatter.close()

In-band tails (`Formatter.error_tail`), chosen so that every client sees a complete record:
- jsonlines: the compact body plus ``"\\n"`` (LMI sends it without the newline; we add it so
  line-splitting clients parse a complete last line);
- sse: ``data: `` + compact body + ``\\n\\n`` (LMI sends the raw body, which SSE clients such as
  huggingface_hub silently ignore; as a ``data:`` event they raise, as §10 recommends);
- json (non-streaming): nothing can have been sent, so its tail is the plain 424 body.
"""

from __future__ import annotations

import json

from lmiserve.core.events import StepEvent
from lmiserve.protocols.lmi.formatters.base import is_error_finish

__all__ = [
    "DEFAULT_ERROR_MESSAGE",
    "dynamic_batch_error_body",
    "error_message",
    "frontend_error_body",
    "is_error_finish",
    "jsonlines_error_tail",
    "lmi_error_body",
    "sse_error_tail",
]

DEFAULT_ERROR_MESSAGE = "exception occurred during rolling batch inference"
ERROR_CONTENT_TYPE = "application/json"


def error_message(event: StepEvent) -> str:
    """The message to report for an error finish (the engine's, or LMI's generic one)."""
    finish = event.finish
    return (finish.error if finish is not None else None) or DEFAULT_ERROR_MESSAGE


def lmi_error_body(message: str, code: int = 424) -> bytes:
    """``{"error":"<message>","code":424}`` — compact, no trailing newline."""
    body = {"error": message, "code": code}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def sse_error_tail(message: str, code: int = 424) -> bytes:
    return b"data: " + lmi_error_body(message, code) + b"\n\n"


def jsonlines_error_tail(message: str, code: int = 424) -> bytes:
    return lmi_error_body(message, code) + b"\n"


def frontend_error_body(code: int, type: str, message: str) -> bytes:
    """Front-end error: pretty-printed (2 spaces) ``code, type, message`` and a final newline."""
    body = {"code": code, "type": type, "message": message}
    return (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode()


def dynamic_batch_error_body(message: str, code: int = 424) -> bytes:
    """Dynamic-batch handler failure: ``{"code": 424, "message": "invoke handler failure", ...}``."""
    body = {"code": code, "message": "invoke handler failure", "error": message}
    return json.dumps(body, ensure_ascii=False).encode()
