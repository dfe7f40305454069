"""The served models by name: loaded together at start, registered and unregistered at run time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from lmiserve.core.errors import ModelNotFound, ModelRequired, NoTextModel
from lmiserve.core.stats import EngineObserver
from lmiserve.models.service import ModelService

log = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(
        self,
        services: list[ModelService] | None = None,
        *,
        observe: Callable[[ModelService], EngineObserver] | None = None,
    ) -> None:
        """`observe` makes the observer of each model's engine (for the metrics), on registration."""
        self._services: dict[str, ModelService] = {}
        self._observe = observe
        for service in services or []:
            self.add(service)

    # ---- lookup ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ModelService]:
        return iter(list(self._services.values()))

    def __len__(self) -> int:
        return len(self._services)

    def __contains__(self, name: str) -> bool:
        return self.find(name) is not None

    def find(self, name: str) -> ModelService | None:
        service = self._services.get(name)
        if service is None:  # a name fixed only after loading (e.g. the bundled default)
            service = next((s for s in self._services.values() if s.name == name), None)
        return service

    def get(self, name: str) -> ModelService:
        service = self.find(name)
        if service is None:
            raise ModelNotFound(f"Model or workflow not found: {name}")
        return service

    def default(self) -> ModelService:
        """The only model; with several, the LLM (if exactly one); else a 400 asking for model_name."""
        services = list(self._services.values())
        if len(services) == 1:
            return services[0]
        llms = [s for s in services if s.is_llm]
        if len(llms) == 1:
            return llms[0]
        raise ModelRequired("Parameter model_name is required.")

    def default_llm(self) -> ModelService:
        llms = [s for s in self._services.values() if s.is_llm]
        if len(llms) == 1:
            return llms[0]
        if not llms:
            raise NoTextModel("No text-generation model is loaded: this route needs an LLM.")
        raise ModelRequired("Parameter model_name is required.")

    @property
    def all_ready(self) -> bool:
        return all(s.status == ModelService.READY for s in self._services.values())

    # ---- changes -----------------------------------------------------------------------------------
    def add(self, service: ModelService) -> None:
        if service.name in self:
            raise ValueError(f"model {service.name!r} is already registered")
        if self._observe is not None:
            service.observers.append(self._observe(service))
        self._services[service.name] = service

    async def remove(self, name: str) -> ModelService:
        """Unregister and stop the model; ModelNotFound if unknown."""
        service = self.get(name)
        for key, value in list(self._services.items()):
            if value is service:
                del self._services[key]
        await service.close()
        return service

    async def load_all(self, on_failed: Callable[[ModelService], None] | None = None) -> None:
        """Load every model; `on_failed(service)` as soon as one fails (the others keep loading)."""

        async def load(service: ModelService) -> None:
            await service.load()
            if service.status == ModelService.FAILED and on_failed is not None:
                on_failed(service)

        await asyncio.gather(*(load(s) for s in self._services.values()))

    async def close_all(self) -> None:
        for service in list(self._services.values()):
            try:
                await service.close()
            except Exception:  # noqa: BLE001 - stop the others anyway
                log.exception("stopping model %s failed", service.name)
