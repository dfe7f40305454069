"""LoRA adapters with `engine_process`: the registry (engine/lora/registry.py) lives with the engine, in the
engine process, where requests acquire their adapters; the adapter routes, the request lookups and the
metrics are the server's.

`RemoteAdapters` is the registry as the serving process sees it (`lora.registry.Adapters`): a mirror of its
entries (names, sources, whether loaded and at what rank, requests, those running), which the engine
process sends with a step's message whenever the registry changed (`AdapterRegistry.version`), and its
changes (register, update, unregister) as calls answered over the pipe, each answer
carrying the mirror as it left the registry. An answer is taken by the client's reader thread itself (not
the event loop): a route may wait for it on the loop. `mirror_of` and `call` are the engine side's half.
The adapters named at start are registered in the engine process before it reports ready
(`models/compose.register_start_adapters`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmiserve.core.errors import GenerationFailed, ModelNotReady
from lmiserve.engine.lora.adapters import LoraAdapter
from lmiserve.engine.lora.registry import AdapterEntry, AdapterRegistry, LoraLimits

__all__ = ["CALLS", "Mirror", "RemoteAdapters", "RemoteLoad", "call", "mirror_of"]

CALLS = ("register", "update", "unregister")  # what the serving process may ask of the registry
CALL_TIMEOUT_S = 3600.0  # reading a large adapter may take long; the engine process dying ends the wait


@dataclass(eq=False)
class RemoteLoad(LoraAdapter):
    """A load of an adapter as the serving process knows it: its rank, targets and size, not its weights."""

    targets: tuple[str, ...] = ()
    size: int = 0

    @property
    def target_modules(self) -> list[str]:
        return list(self.targets)

    @property
    def nbytes(self) -> int:
        return self.size


@dataclass(frozen=True)
class Mirror:
    """What the registry said at `version`: its entries (weights left out), requests running, loads held."""

    version: int = -1
    entries: dict[str, AdapterEntry] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    loaded: int = 0


def _summary(entry: AdapterEntry) -> AdapterEntry:
    load = entry.loaded
    if load is not None and not isinstance(load, RemoteLoad):
        load = RemoteLoad(
            load.name, load.path, {}, load.rank, load.alpha, load.base_model, load.load_seconds, load.id,
            targets=tuple(load.target_modules), size=load.nbytes,
        )  # fmt: skip
    return replace(entry, loaded=load)


def mirror_of(registry: AdapterRegistry) -> Mirror:
    """The engine side: `registry` as the serving process mirrors it."""
    version = registry.version
    entries = {e.name: _summary(e) for e in registry.entries()}
    return Mirror(version, entries, registry.running(), registry.loaded_count())


def call(registry: AdapterRegistry, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The engine side: one of `CALLS` on `registry` (blocking: a worker thread's), its entry summarized."""
    if method not in CALLS:
        raise ValueError(f"not a registry call: {method}")
    result = getattr(registry, method)(*args, **kwargs)
    return _summary(result) if isinstance(result, AdapterEntry) else result


@dataclass
class _Waiter:
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None


class RemoteAdapters:
    """The engine process's adapter registry, from the serving process (module doc); `send` sends a
    message to the engine process."""

    def __init__(
        self, send: Callable[[tuple[Any, ...]], None], limits: LoraLimits, mirror: Mirror, reserved: set[str]
    ) -> None:
        self.limits = limits
        self.reserved = reserved  # the served model's own names (the registry refuses them too)
        self._send = send
        self._mirror = mirror
        self._lock = threading.Lock()
        self._calls: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self._failure: BaseException | None = None

    # ---- the mirror ----------------------------------------------------------------------------------
    def mirror(self, mirror: Mirror) -> None:
        """Take `mirror` if it is newer than the one held (a step's message may come after an answer)."""
        with self._lock:
            if mirror.version > self._mirror.version:
                self._mirror = mirror

    def names(self) -> list[str]:
        return list(self._mirror.entries)

    def get(self, name: str) -> AdapterEntry | None:
        return self._mirror.entries.get(name)

    def entries(self) -> list[AdapterEntry]:
        return list(self._mirror.entries.values())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._mirror.entries

    def in_use(self, name: str) -> int:
        return self._mirror.running.get(name, 0)

    def running(self) -> dict[str, int]:
        return dict(self._mirror.running)

    def loaded_count(self) -> int:
        return self._mirror.loaded

    # ---- changes: calls to the engine process ----------------------------------------------------------
    def register(self, name: str, src: str | Path, *, preload: bool = True, pin: bool = False) -> AdapterEntry:
        entry: AdapterEntry = self._call("register", name, str(src), preload=preload, pin=pin)
        return entry

    def update(
        self, name: str, *, src: str | Path | None = None, pin: bool | None = None, preload: bool = True
    ) -> AdapterEntry:
        folder = None if src is None else str(src)
        entry: AdapterEntry = self._call("update", name, src=folder, pin=pin, preload=preload)
        return entry

    def unregister(self, name: str) -> AdapterEntry:
        entry: AdapterEntry = self._call("unregister", name)
        return entry

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Ask the engine process and wait for its answer (blocking: any thread, the event loop's too, as
        the reader thread takes answers); its error is raised here."""
        waiter = _Waiter()
        with self._lock:
            if self._failure is not None:
                raise self._failure
            number = next(self._ids)
            self._calls[number] = waiter
        self._send(("adapters", number, method, args, kwargs))
        if not waiter.done.wait(CALL_TIMEOUT_S):
            with self._lock:
                self._calls.pop(number, None)
            raise GenerationFailed(f"the engine process did not answer {method} of the adapters")
        if isinstance(waiter.result, BaseException):
            raise waiter.result
        return waiter.result

    def answered(self, number: int, result: Any, mirror: Mirror) -> None:
        """The engine process's answer to call `number` (the reader thread's)."""
        self.mirror(mirror)
        with self._lock:
            waiter = self._calls.pop(number, None)
        if waiter is not None:
            waiter.result = result
            waiter.done.set()

    def fail(self, why: str) -> None:
        """The engine process is gone: the calls waiting and those to come fail."""
        with self._lock:
            self._failure = ModelNotReady(f"The model cannot serve: {why}")
            waiting, self._calls = list(self._calls.values()), {}
        for waiter in waiting:
            waiter.result = self._failure
            waiter.done.set()
