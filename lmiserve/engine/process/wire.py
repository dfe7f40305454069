"""What crosses the pipe between the serving process (client.py) and the engine's (host.py).

Serving process -> engine: ``("generate", rid, request)``, ``("abort", rid)``, ``("prepare", call, request)``,
``("stop",)``. Engine -> serving process: ``("batch", items, observed, snapshot)`` (each ``(rid, item)`` an
event, an `Ended` or the request's error; `observed` the observers' calls, in order), ``("reply", call,
error or None)``, ``("failure", why)``. One batch a step: what one step delivers goes in one message.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

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
