"""What crosses the pipe between the serving process (client.py) and the engine's (host.py).

Serving process -> engine: ``("generate", rid, request)``, ``("abort", rid)``, ``("prepare", call, request)``,
``("adapters", call, method, args, kwargs)`` (a change to the LoRA registry: process/adapters.py),
``("stop",)``. Engine -> serving process: ``("batch", items, observed, snapshot, adapters)`` (each ``(rid,
item)`` an event, an `Ended` or the request's error; `observed` the observers' calls, in order; `adapters`
the LoRA registry's mirror when it changed, else None), ``("reply", call, error or None)``,
``("adapters_reply", call, result or error, mirror)``, ``("failure", why)``, ``("log", record)`` (the engine
process's log records, written by the serving process's logging: one format, one stream). One batch a step:
what one step delivers goes in one message.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from lmiserve.core.errors import GenerationFailed
from lmiserve.core.request_context import Generation


@dataclass(frozen=True)
class Ended:
    """A request's last item: its events are all sent; what the engine ran for it (the traces' spans)."""

    generations: tuple[Generation, ...]


def portable(error: BaseException) -> BaseException:
    """`error` as it can cross the pipe: itself when it pickles (every `LmiServeError` does), else a
    `GenerationFailed` naming it."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any exception that does not survive pickling is named instead
        return GenerationFailed(f"exception occurred during generation: {type(error).__name__}: {error}")
    return error


class PipeSender:
    """Sends messages over `conn` from any thread, one at a time; a closed pipe (the other process gone) is
    not an error here: its reader finds out."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock, contextlib.suppress(OSError, EOFError, ValueError):
            self.conn.send(message)


_PLAIN = (str, int, float, bool, type(None))


class PipeLogHandler(logging.Handler):
    """The engine process's log records, sent to the serving process (`emit_forwarded` writes them there):
    the message formatted with its traceback, the record's plain attributes kept (`request_id`, ...)."""

    def __init__(self, sender: PipeSender) -> None:
        super().__init__()
        self.sender = sender
        self.setFormatter(logging.Formatter("%(message)s"))  # the message and its traceback: the rest is the record's

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            state = {k: v for k, v in record.__dict__.items() if isinstance(v, _PLAIN)}
            state.update(msg=message, args=None, exc_text=None, stack_info=None)
            self.sender.send(("log", state))
        except Exception:  # noqa: BLE001 - logging's own rule: a record that fails is reported, never raised
            self.handleError(record)


def emit_forwarded(state: dict[str, Any]) -> None:
    """Log a record of the engine process here, through its logger's handlers."""
    record = logging.makeLogRecord(state)
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)
