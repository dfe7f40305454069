"""The Python heap of a serving process, once its model is loaded: frozen out of the garbage collector's way.

A loaded model leaves millions of long-lived objects (modules, tokenizer tables, configs, compiled
kernels' caches) in the collector's oldest generation, and every full collection walks them all again: at
many concurrent streams the objects a step makes (events, chunks) set off collections often enough that
this walk becomes a share of each token's CPU (`benchmarks/README.md`, "The engine core in a process of
its own"). `gc.freeze()` moves everything alive now into a permanent generation that collections skip;
what is allocated later is collected as before. vLLM and SGLang freeze their heap after start-up likewise.
A model unloaded (the management API) thaws it: its cycles are collected again, and the next model's load
freezes what is left.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze() -> int:
    """Collect, then freeze what is alive (a second call freezes what came since); the objects frozen in all."""
    start = time.monotonic()
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    log.debug("heap frozen: %d objects out of the collector's way (%.0f ms)", count, 1000 * (time.monotonic() - start))
    return count


def thaw() -> None:
    """Give the frozen objects back to the collector (a model was unloaded: its cycles can go)."""
    gc.unfreeze()
