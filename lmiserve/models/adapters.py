"""A model's LoRA adapters managed at run time: what the adapters APIs of every protocol do (LMI's and
SageMaker's ``/adapters`` routes, vLLM's ``/v1/load_lora_adapter``), in neutral errors each protocol
words and answers its own way.

- The model must be a loaded LLM served with `enable_lora` (else InvalidRequest, saying so).
- Runtime registration reads only from `model_store` and `allowed_model_paths`, as `POST /models` does
  (`store.allowed_path`: Forbidden outside them), or fetches a Hub id, `s3://` or `gs://` URL that
  `allowed_model_urls` lists (`store.remote_source`); the adapters named at start are the operator's and
  are not checked (models/service.py).
- An adapter that does not fit the model (rank above `max_lora_rank`, a target module it does not have
  or may not adapt, shapes of another model) is InvalidRequest with the reason (`lora.AdapterError`),
  as is a bad name (a model's name included); a name already registered is the caller's `exists` error
  (LMI: Conflict, vLLM: InvalidRequest), an unknown one its `unknown` error (AdapterNotFound).
- Reading an adapter's files is blocking: it runs on a worker thread.
- Unregistering an adapter that requests are running on lets them finish on its weights
  (`AdapterRegistry.unregister`); new requests naming it are refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmiserve.core.errors import AdapterNotFound, Conflict, InvalidRequest, LmiServeError
from lmiserve.models.service import ModelService
from lmiserve.models.store import allowed_path

if TYPE_CHECKING:
    from lmiserve.engine.lora.registry import AdapterEntry, Adapters

__all__ = [
    "LMI",
    "Wording",
    "adapters_of",
    "describe",
    "entry",
    "flag",
    "register",
    "unregister",
    "update",
]


def _exists(name: str) -> LmiServeError:
    return Conflict(f"Adapter {name} is already registered.")


def _unknown(name: str) -> LmiServeError:
    return AdapterNotFound(f"Adapter {name} is not registered")


@dataclass(frozen=True)
class Wording:
    """A protocol's errors for a name already registered and for an unknown one (LMI's by default)."""

    exists: Callable[[str], LmiServeError] = field(default=_exists)
    unknown: Callable[[str], LmiServeError] = field(default=_unknown)


LMI = Wording()


def adapters_of(service: ModelService) -> Adapters:
    """The adapters of `service` (ModelNotReady while it loads; InvalidRequest when it serves none)."""
    service.ready_engine()
    registry = service.adapters
    if registry is None:
        raise InvalidRequest(
            f"Model {service.name} does not serve LoRA adapters: start it with enable_lora=true "
            "(or name adapters with lora_modules)."
        )
    return registry


def flag(value: Any, name: str, default: bool) -> bool:
    """A boolean option given as JSON (true/false) or text (true/false, 1/0, yes/no); InvalidRequest else."""
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise InvalidRequest(f"Parameter {name} must be true or false: {value}")


def _text(value: Any, name: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise InvalidRequest(f"Parameter {name} is required.")
    if not isinstance(value, str):
        raise InvalidRequest(f"Parameter {name} must be a string.")
    return value


async def _source(src: Any, roots: list[Path], param: str, service: ModelService) -> Path:
    """The local folder of adapter source `src`: a path under `roots`, or a Hub id / s3:// / gs:// URL that
    `allowed_model_urls` lists, fetched now (on a worker thread)."""
    from lmiserve.models.download import DownloadError, adapter_options, fetch
    from lmiserve.models.store import remote_source

    text = _text(src, param)
    remote = remote_source(text, service.settings, what="Adapter")
    if remote is None:
        return allowed_path(text, roots, what="Adapter", param=param)
    try:
        return await asyncio.to_thread(fetch, remote, adapter_options(service.settings))
    except DownloadError as exc:
        raise InvalidRequest(f"Adapter {text} could not be downloaded: {exc}") from None


def _check_pin(registry: Adapters, name: str) -> None:
    """Pinned adapters never leave memory: at most `max_cpu_loras` of them, so that room is left."""
    pinned = [e.name for e in registry.entries() if e.pinned and e.name != name]
    kept = registry.limits.kept
    if len(pinned) >= kept:
        raise InvalidRequest(
            f"Adapter {name} cannot be pinned: {len(pinned)} adapters are pinned already and at most "
            f"max_cpu_loras ({kept}) stay loaded; unpin one first."
        )


async def register(
    service: ModelService,
    name: Any,
    src: Any,
    *,
    roots: list[Path],
    preload: bool = True,
    pin: bool = False,
    models: Collection[str] = (),
    wording: Wording = LMI,
    name_param: str = "name",
    src_param: str = "src",
) -> AdapterEntry:
    """Register adapter `name` of `service` from `src` (under `roots`); `models`: the served models'
    names, which no adapter may take (a request's `model` names either)."""
    registry = adapters_of(service)
    name = _text(name, name_param)
    if name in registry:
        raise wording.exists(name)
    if name in models or name in registry.reserved:
        raise InvalidRequest(f"Adapter name {name} is the name of a served model.")
    folder = await _source(src, roots, src_param, service)
    if pin:
        _check_pin(registry, name)
    try:
        return await asyncio.to_thread(registry.register, name, folder, preload=preload, pin=pin)
    except FileExistsError:
        raise wording.exists(name) from None
    except ValueError as exc:  # lora.AdapterError (does not fit) or a bad name: the message says which
        raise InvalidRequest(str(exc)) from None


async def update(
    service: ModelService,
    name: str,
    *,
    roots: list[Path],
    src: Any = None,
    pin: bool | None = None,
    preload: bool = True,
    wording: Wording = LMI,
    src_param: str = "src",
) -> AdapterEntry:
    """Change adapter `name`'s source (read again; requests running on the old weights finish on them)
    or its pinning."""
    from lmiserve.engine.lora.registry import UnknownAdapter

    registry = adapters_of(service)
    if name not in registry:
        raise wording.unknown(name)
    folder = await _source(src, roots, src_param, service) if src is not None else None
    if pin:
        _check_pin(registry, name)
    try:
        return await asyncio.to_thread(registry.update, name, src=folder, pin=pin, preload=preload)
    except UnknownAdapter:
        raise wording.unknown(name) from None
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def unregister(service: ModelService, name: str, *, wording: Wording = LMI) -> AdapterEntry:
    """Forget adapter `name`; the requests running on it finish first, on its weights."""
    from lmiserve.engine.lora.registry import UnknownAdapter

    registry = adapters_of(service)
    try:
        return registry.unregister(name)
    except UnknownAdapter:
        raise wording.unknown(name) from None


def entry(service: ModelService, name: str, *, wording: Wording = LMI) -> AdapterEntry:
    """The registered adapter `name` (the `unknown` error else)."""
    found = adapters_of(service).get(name)
    if found is None:
        raise wording.unknown(name)
    return found


def describe(registry: Adapters, found: AdapterEntry) -> dict[str, Any]:
    """What is known of a registered adapter: loaded or not, and when loaded its rank, targets, size."""
    loaded = found.loaded
    return {
        "loaded": loaded is not None,
        "rank": loaded.rank if loaded is not None else None,
        "target_modules": loaded.target_modules if loaded is not None else None,
        "nbytes": loaded.nbytes if loaded is not None else None,
        "requests": found.requests,
        "running": registry.in_use(found.name),
        "error": found.error,
    }
