"""Triton's compilations, watched from the warm-up on: a kernel compiled after the warm-up is logged.

On a GPU, Triton compiles a kernel once for each kind of launch: its constexprs and each argument's
specialization (an int equal to 1, divisible by 16 or neither; a pointer aligned to 16 bytes or not). A
compilation takes a few hundred milliseconds, and the step that needs it waits, with every request in it.
The warm-up (engine/core/warmup.py) runs the launches serving needs, and the launches keep the same kind
from step to step (engine/attention/triton_ops.py: the values that change with the step are not
specialized on, the arrays start aligned). Should a compilation still happen once the warm-up is done, it
is logged as a warning, with the kernel, its arguments' kinds and the seconds it took: what a time to first
token or an inter-token gap of that size was (``kernel_compiles.after_warm_up`` counts them). A warm-up
runs inside `warming`; while one runs (a model loaded at run time warms up as others serve), nothing is
logged.

Installed through Triton's own hooks (``triton.knobs.runtime.jit_cache_hook`` before a compilation,
``jit_post_compile_hook`` after; Triton 3.4 and later), chained to any hook already set. Nothing is
installed without Triton, under its interpreter (which compiles nothing) or on a Triton without the knobs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["after_warm_up", "warming", "watch"]

log = logging.getLogger(__name__)


class _Watch:
    """The hooks' state: when each compilation started, whether the warm-up is done, the count after it."""

    def __init__(self, before: Callable[..., Any] | None, after: Callable[..., Any] | None) -> None:
        self.previous_before, self.previous_after = before, after
        self.started: dict[str, float] = {}
        self.warmed = False  # a warm-up has finished
        self.warming = 0  # warm-ups running (a model loaded at run time warms up while others serve)
        self.after_warm_up = 0
        self.lock = threading.Lock()

    def before(self, **info: Any) -> Any:
        with self.lock:
            self.started[str(info.get("key"))] = time.perf_counter()
        # a hook that returns True skips the compilation: the chained hook's answer is kept
        return self.previous_before(**info) if self.previous_before is not None else None

    def after(self, **info: Any) -> Any:
        with self.lock:
            began = self.started.pop(str(info.get("key")), None)
            late = self.warmed and not self.warming
            if late:
                self.after_warm_up += 1
        if late:
            fn = info.get("fn")
            name = getattr(fn, "name", None) or "a kernel"
            seconds = "" if began is None else f" in {time.perf_counter() - began:.2f} s"
            log.warning(
                "Triton compiled %s after the warm-up%s, while a step waited for it: a launch the warm-up did "
                "not run (%s)",
                name,
                seconds,
                info.get("repr", ""),
            )
        return self.previous_after(**info) if self.previous_after is not None else None


_watch: _Watch | None = None


def _knobs() -> Any | None:
    """Triton's runtime knobs where compilations can be watched (Triton installed, compiling, with the
    hooks), else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # noqa: BLE001 - a broken Triton: nothing to watch
        return None
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or getattr(runtime, "interpret", False):
        return None
    return runtime


def watch() -> bool:
    """Watch Triton's compilations from now on (once a process); whether they are watched."""
    global _watch
    if _watch is not None:
        return True
    runtime = _knobs()
    if runtime is None:
        return False
    _watch = _Watch(runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    runtime.jit_cache_hook = _watch.before
    runtime.jit_post_compile_hook = _watch.after
    return True


@contextlib.contextmanager
def warming() -> Iterator[None]:
    """A warm-up runs inside: its compilations are expected. Once it ends (and while no other warm-up
    runs), a compilation is logged."""
    watching = _watch if watch() else None
    if watching is None:
        yield
        return
    with watching.lock:
        watching.warming += 1
    try:
        yield
    finally:
        with watching.lock:
            watching.warming -= 1
            watching.warmed = True


def after_warm_up() -> int:
    """Compilations logged: after a warm-up, outside any (0 when not watched)."""
    return 0 if _watch is None else _watch.after_warm_up
