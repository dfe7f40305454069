"""The LoRA adapters' weights beside a runner, in the runner's own process: read from each adapter's
folder and kept by the load id the engine's registry gave it.

The engine core names a request's adapter in the step contract as plain data (`step.AdapterRef`: its
name, load id and PEFT folder). `LoraManager.get` gives the runner a load's weights: those it keeps, else
read now from the folder (checked against the model as `lora.read_adapter` checks; on a tensor-parallel
rank then cut to the rank's shard, `model.sharding.shard_adapter`) and kept under the load's id. A batch's
`dropped_adapters` names the loads the registry let go (unloaded past `max_cpu_loras`, unregistered or
updated from other files, once no request holds them): the manager forgets them (`drop`), so it keeps
what the registry keeps, and `max_cpu_loras` bounds every rank's memory as it bounds the engine's.

In the engine's own process the registry reads adapters through the runner's manager (`load`, passed as
the registry's loader): one read and one copy of the weights, which `get` then finds. Those the manager
holds weakly: they live as long as the registry or a request holds them, so an adapter the registry
unloads frees its memory at once, not at the next step (registering many adapters at start, beyond
`max_cpu_loras`, holds no more than `max_cpu_loras` of them). A tensor-parallel rank reads an adapter on
the first batch that names a load of it and holds it until a batch drops it.

Thread-safe: the registry loads on worker threads, the runner reads on the model's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lmiserve.engine.lora.adapters import LoraAdapter, read_adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from lmiserve.engine.core.step import AdapterRef

__all__ = ["LoraManager"]

log = logging.getLogger(__name__)


class LoraManager:
    """The adapter loads a runner over `model` serves, by id. `modules`: the short names of the linears
    the runner applies adapters to (None: any linear); `shard`: what a rank keeps of a load read whole
    (None: all of it)."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_rank: int,
        modules: Sequence[str] | None = None,
        shard: Callable[[LoraAdapter], LoraAdapter] | None = None,
    ) -> None:
        self.model = model
        self.max_rank = max_rank
        self.modules = tuple(modules) if modules is not None else None
        self.shard = shard
        self._kept: dict[int, LoraAdapter] = {}  # loads read by `get`: held until dropped
        self._lent: weakref.WeakValueDictionary[int, LoraAdapter] = weakref.WeakValueDictionary()  # by `load`
        self._lock = threading.Lock()

    def load(self, name: str, folder: Path) -> LoraAdapter:
        """Adapter `name` read from `folder` now, as a new load (a new id), for the caller to hold (the
        registry): `get` finds it while anyone does (`lora.AdapterError`: it does not fit the model)."""
        adapter = self._read(name, folder)
        with self._lock:
            self._lent[adapter.id] = adapter
        return adapter

    def get(self, ref: AdapterRef) -> LoraAdapter:
        """The weights of load `ref`: kept, else read from its folder now and kept under its id
        (`lora.AdapterError`, OSError: its files no longer load)."""
        with self._lock:
            found = self._kept.get(ref.id) or self._lent.get(ref.id)
        if found is not None:
            return found
        adapter = dataclasses.replace(self._read(ref.name, Path(ref.path)), id=ref.id)
        log.info(
            "adapter %s (load %d) read from %s: rank %d, %.1f MiB in %.0f ms",
            ref.name,
            ref.id,
            ref.path,
            adapter.rank,
            adapter.nbytes / 2**20,
            adapter.load_seconds * 1000,
        )
        with self._lock:
            return self._kept.setdefault(ref.id, adapter)

    def drop(self, ids: Iterable[int]) -> None:
        """Forget these loads' weights (the requests still running on one keep it until they finish)."""
        with self._lock:
            for adapter_id in ids:
                self._kept.pop(adapter_id, None)
                self._lent.pop(adapter_id, None)

    def kept(self) -> list[int]:
        """The ids of the loads `get` finds now (without reading)."""
        with self._lock:
            return sorted({*self._kept, *self._lent.keys()})

    def _read(self, name: str, folder: Path) -> LoraAdapter:
        adapter = read_adapter(folder, self.model, name=name, max_rank=self.max_rank, modules=self.modules)
        return self.shard(adapter) if self.shard is not None else adapter
