"""Where log lines go and how they look: `--log-format text` (default) or `json`, for every logger
(lmiserve's, uvicorn's, the libraries'), each line naming the request it is about.

- text: ``2026-11-24 10:00:00,123 INFO lmiserve.access [3f2a...]: method=POST ...``; the bracket holds
  the request id and is left out of lines that are about no request;
- json: one object per line, ``{"time", "level", "logger", "message", "request_id"?, ...}``; the
  access line's fields (lmiserve.server.access) are top-level keys (its message is just
  ``METHOD path status``); a traceback is ``exc_info``.

The request id comes from the record (``extra={"request_id": ...}``, as the engine's loop logs about a
sequence) or else from the request being served in the logging context (lmiserve.core.request_context).
A formatter of our own rather than python-json-logger: it is twenty lines, and the field names, the
UTC timestamps and the access fields as top-level keys are ours to choose either way.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

from lmiserve.core.request_context import current_request_id
from lmiserve.models.download.progress import CHATTY_LOGGERS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


class RequestIdFilter(logging.Filter):
    """Gives every record ``request_id`` (None outside a request) and ``request_tag`` (`` [id]`` or "")."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or current_request_id()
        record.request_id = request_id
        record.request_tag = f" [{request_id}]" if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            doc["request_id"] = request_id
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):  # the access line: its fields as keys, a short message
            doc["message"] = f"{fields.get('method')} {fields.get('path')} {fields.get('status')}"
            doc.update(fields)
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Send every logger's lines to stderr in `log_format` ("text" or "json") at `level`; uvicorn's
    loggers propagate to the same handler (start uvicorn with ``log_config=None``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for name in CHATTY_LOGGERS:  # a line a request of a model download: the download logs its own progress
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)  # Python warnings become log lines too (logger py.warnings)
    if log_format == "json":
        # progress bars (transformers' "Loading weights") are not log lines; read when transformers loads
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
