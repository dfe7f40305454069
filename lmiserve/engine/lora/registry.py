"""The adapters a model serves: registered by name, loaded on demand, kept within `max_cpu_loras`.

A registered adapter is a name and a source folder (and whether it is pinned). Its weights are read
(`lora.read_adapter`) when it is registered with `preload`, else on its first request; at most
`max_cpu_loras` adapters stay loaded, and when one more is loaded the least recently used one that no
request is using and that is not pinned is dropped (it loads again on its next request).

A request `acquire`s its adapter for as long as it runs and `release`s it at its end: an adapter in
use is never dropped, and unregistering it (or updating it from another source) lets the requests
that hold it finish on the weights they started with. Every load is a new `LoraAdapter` (a new id), so
the prefix cache never shares blocks between two loads.

The registry reads an adapter through its `loader` (default: `lora.read_adapter` on `model`): in the
engine's own process the runner's `lora.manager.LoraManager.load`, so the runner finds the weights the
registry read; over tensor-parallel workers the model is a shell without weights (its parameters on the
meta device) and the registry's loads are checks and bookkeeping, each rank reading its shard of a load
when a step first names it. Either way the runner's side learns which loads the registry let go
(`take_dropped`, sent as a step's `dropped_adapters`) and forgets them.

Thread-safe: registration and loading happen on worker threads (`asyncio.to_thread`), requests
acquire on the event loop, the model's thread reads weights through the `LoraAdapter` objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lmiserve.engine.lora.adapters import AdapterError, LoraAdapter, read_adapter, read_config

Loader = Callable[[str, Path], LoraAdapter]  # (name, folder) -> a new load of the adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["AdapterEntry", "AdapterRegistry", "Adapters", "LoraLimits", "UnknownAdapter"]

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    """No adapter of that name is registered."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass(frozen=True)
class LoraLimits:
    """vLLM's and LMI's names: adapters active in one step, their highest rank, adapters kept loaded."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    @property
    def kept(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


@dataclass
class AdapterEntry:
    """One registered adapter: its source, whether it is pinned (never dropped), its weights when loaded."""

    name: str
    src: Path
    pinned: bool = False
    loaded: LoraAdapter | None = None
    registered_at: float = field(default_factory=time.time)
    last_used: float = 0.0
    requests: int = 0  # requests served, since registration
    error: str | None = None  # why its last load failed

    @property
    def is_loaded(self) -> bool:
        return self.loaded is not None


class Adapters(Protocol):
    """A model's adapters as the server's routes and lookups use them: the `AdapterRegistry` itself in the
    engine's process, its mirror in the server's with `engine_process` (engine/process/adapters.py)."""

    limits: LoraLimits
    reserved: set[str]

    def names(self) -> list[str]: ...
    def get(self, name: str) -> AdapterEntry | None: ...
    def entries(self) -> list[AdapterEntry]: ...
    def __contains__(self, name: object) -> bool: ...
    def in_use(self, name: str) -> int: ...
    def running(self) -> dict[str, int]: ...
    def loaded_count(self) -> int: ...
    def register(self, name: str, src: str | Path, *, preload: bool = True, pin: bool = False) -> AdapterEntry: ...
    def update(
        self, name: str, *, src: str | Path | None = None, pin: bool | None = None, preload: bool = True
    ) -> AdapterEntry: ...
    def unregister(self, name: str) -> AdapterEntry: ...


class AdapterRegistry:
    """The adapters of one model (`model`, the base), served through the paths that apply `modules`
    (None: any linear); `loader` reads an adapter (default: `lora.read_adapter` on `model`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        limits: LoraLimits,
        *,
        modules: Sequence[str] | None = None,
        reserved_names: Sequence[str] = (),
        loader: Loader | None = None,
    ) -> None:
        self.model = model
        self.limits = limits
        self.modules = tuple(modules) if modules is not None else None
        self.reserved = set(reserved_names)  # the served model's own names: never an adapter's
        self._loader = loader
        self._entries: dict[str, AdapterEntry] = {}
        self._refs: dict[int, int] = {}  # LoraAdapter.id -> requests holding it
        self._held: dict[int, LoraAdapter] = {}  # the adapters requests hold, by id
        self._dropped: list[int] = []  # loads let go since `take_dropped` (the runner's side forgets them)
        self._lock = threading.RLock()
        self._loading: dict[str, threading.Lock] = {}
        self.listeners: list[Callable[[str, str], None]] = []  # (event, name): "registered", "unregistered"
        self.version = 0  # counts the changes of what `entries`, `running` and `loaded_count` say

    # ---- what is registered ------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def get(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.get(name)

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def in_use(self, name: str) -> int:
        """Requests now running on adapter `name` (any of its loads)."""
        with self._lock:
            entry = self._entries.get(name)
            loaded = entry.loaded if entry is not None else None
            return self._refs.get(loaded.id, 0) if loaded is not None else 0

    # ---- registration (blocking: run it on a worker thread) -------------------------------------------
    def register(self, name: str, src: str | Path, *, preload: bool = True, pin: bool = False) -> AdapterEntry:
        """Register adapter `name` from folder `src`; with `preload` its weights are read and checked now
        (AdapterError: they do not fit; nothing is registered then). ValueError: a bad or taken name."""
        _check_name(name)
        if name in self.reserved:
            raise ValueError(f"adapter name {name!r} is the served model's own name")
        with self._lock:
            if name in self._entries:
                raise FileExistsError(f"adapter {name!r} is already registered")
        folder = Path(src).expanduser().resolve()
        adapter = self._read_or_check(name, folder, preload or pin)
        with self._lock:
            if name in self._entries:
                if adapter is not None:
                    self._dropped.append(adapter.id)
                raise FileExistsError(f"adapter {name!r} is already registered")
            entry = AdapterEntry(name, folder, pinned=pin, loaded=adapter)
            if adapter is not None:
                entry.last_used = time.monotonic()
            self._entries[name] = entry
            self._evict()
            self.version += 1
        log.info(
            "adapter %s registered from %s%s%s",
            name,
            folder,
            f" (rank {adapter.rank}, {', '.join(adapter.target_modules)}, {adapter.load_seconds * 1000:.0f} ms)"
            if adapter
            else " (loads on its first request)",
            ", pinned" if pin else "",
        )
        self._tell("registered", name)
        return entry

    def update(
        self, name: str, *, src: str | Path | None = None, pin: bool | None = None, preload: bool = True
    ) -> AdapterEntry:
        """Change adapter `name`'s source (its weights are read again; requests running on the old ones
        finish on them) or pinning. UnknownAdapter, AdapterError as `register`."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise UnknownAdapter(name)
        adapter = None
        folder = entry.src
        if src is not None:
            folder = Path(src).expanduser().resolve()
            adapter = self._read_or_check(name, folder, preload or (pin if pin is not None else entry.pinned))
        with self._lock:
            if src is not None:
                before = entry.loaded
                entry.src, entry.loaded, entry.error = folder, adapter, None
                self._drop_if_unused(before)
                if self._entries.get(name) is not entry:  # unregistered meanwhile
                    self._drop_if_unused(adapter)
            if pin is not None:
                entry.pinned = pin
            self._evict()
            self.version += 1
        return entry

    def unregister(self, name: str) -> AdapterEntry:
        """Forget adapter `name` (UnknownAdapter); requests running on it finish first, on its weights."""
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is not None:
                self._drop_if_unused(entry.loaded)  # else when its last request ends (`release`)
                self.version += 1
        if entry is None:
            raise UnknownAdapter(name)
        log.info("adapter %s unregistered", name)
        self._tell("unregistered", name)
        return entry

    # ---- requests ----------------------------------------------------------------------------------
    def acquire(self, name: str) -> LoraAdapter:
        """Adapter `name`'s weights for one request, loaded now if they are not (blocking); held until
        `release`. UnknownAdapter; AdapterError when its files no longer load."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise UnknownAdapter(name)
            adapter = entry.loaded
            if adapter is not None:
                return self._hold(entry, adapter)
            gate = self._loading.setdefault(name, threading.Lock())
        with gate:  # one load of an adapter at a time; the others wait for it
            with self._lock:
                entry = self._entries.get(name)
                if entry is None:
                    raise UnknownAdapter(name)
                adapter, folder = entry.loaded, entry.src
            if adapter is None:
                try:
                    adapter = self._read(name, folder)
                except AdapterError as exc:
                    with self._lock:
                        entry.error = str(exc)
                        self.version += 1
                    raise
                with self._lock:
                    if self._entries.get(name) is entry and entry.src == folder:
                        entry.loaded, entry.error = adapter, None
            with self._lock:
                held = self._hold(entry, adapter)
                self._evict()
                return held

    def needs_load(self, name: str) -> bool:
        """Whether `acquire(name)` would read files (so a caller runs it on a worker thread)."""
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.loaded is None

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            self.version += 1
            left = self._refs.get(adapter.id, 0) - 1
            if left > 0:
                self._refs[adapter.id] = left
            else:
                self._refs.pop(adapter.id, None)
                self._held.pop(adapter.id, None)
                self._drop_if_unused(adapter)  # unregistered, updated or unloaded while it ran
                self._evict()

    def take_dropped(self) -> list[int]:
        """The ids of the loads let go since the last call: no request holds them and no entry keeps them
        (unloaded past `max_cpu_loras`, unregistered, updated from other files), so no request will name
        them again; the engine sends them to the runner's side (`StepBatch.dropped_adapters`)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def _drop_if_unused(self, adapter: LoraAdapter | None) -> None:
        if adapter is None or self._refs.get(adapter.id):
            return
        if any(entry.loaded is adapter for entry in self._entries.values()):
            return
        self._dropped.append(adapter.id)

    def running(self) -> dict[str, int]:
        """Requests holding each adapter now, by name (several loads of one name added up)."""
        with self._lock:
            counts: dict[str, int] = {}
            for adapter_id, adapter in self._held.items():
                counts[adapter.name] = counts.get(adapter.name, 0) + self._refs.get(adapter_id, 0)
            return counts

    def _hold(self, entry: AdapterEntry, adapter: LoraAdapter) -> LoraAdapter:
        self.version += 1  # (under the lock, as every caller holds it; a load it holds is counted here too)
        self._refs[adapter.id] = self._refs.get(adapter.id, 0) + 1
        self._held[adapter.id] = adapter
        entry.last_used = time.monotonic()
        entry.requests += 1
        return adapter

    # ---- memory ------------------------------------------------------------------------------------
    def loaded_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.loaded is not None)

    def _evict(self) -> None:
        """Drop the least recently used loaded adapters (not pinned, not in use) beyond `max_cpu_loras`."""
        loaded = [e for e in self._entries.values() if e.loaded is not None]
        excess = len(loaded) - self.limits.kept
        if excess <= 0:
            return
        for entry in sorted(loaded, key=lambda e: e.last_used):
            if excess <= 0:
                break
            adapter = entry.loaded
            if entry.pinned or adapter is None or self._refs.get(adapter.id):
                continue
            entry.loaded = None
            self._dropped.append(adapter.id)
            excess -= 1
            log.info(
                "adapter %s unloaded from memory (max_cpu_loras %d); it loads again when asked for",
                entry.name,
                self.limits.kept,
            )

    def _read_or_check(self, name: str, folder: Path, load: bool) -> LoraAdapter | None:
        """The adapter in `folder`, read now (`load`), else None once the folder is checked to be a PEFT LoRA
        adapter (its weights are read on its first request)."""
        if load:
            return self._read(name, folder)
        read_config(folder)
        return None

    def _read(self, name: str, folder: Path) -> LoraAdapter:
        if self._loader is not None:
            adapter = self._loader(name, folder)
        else:
            adapter = read_adapter(
                folder, self.model, name=name, max_rank=self.limits.max_lora_rank, modules=self.modules
            )
        log.info(
            "adapter %s loaded: rank %d, %s, %.1f MiB in %.0f ms",
            name,
            adapter.rank,
            ", ".join(adapter.target_modules),
            adapter.nbytes / 2**20,
            adapter.load_seconds * 1000,
        )
        return adapter

    def _tell(self, event: str, name: str) -> None:
        for listener in self.listeners:
            try:
                listener(event, name)
            except Exception:  # noqa: BLE001 - a listener must not fail a registration
                log.exception("adapter listener failed")


def _check_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 256
        or any(c in name for c in "/\\\x00")
        or name != name.strip()
    ):
        raise ValueError(f"invalid adapter name {name!r}: a non-empty name without '/', '\\' or surrounding spaces")
