"""The served model: loads in the background, then owns the engine. /ping reads its state."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from lmiserve.adapters.lmi import Limits
from lmiserve.config import Settings
from lmiserve.core.errors import ModelNotReady

log = logging.getLogger(__name__)


class ModelService:
    PENDING, READY, FAILED = "PENDING", "READY", "FAILED"

    def __init__(self, settings: Settings):
        self.settings = settings
        self.status = self.PENDING
        self.error: str | None = None
        self.path: Path | None = None
        self.loaded = None
        self.engine = None
        self.started_at = time.time()
        self.name = settings.model_name or _initial_name(settings.model_id)
        self.limits = Limits(
            default_max_new_tokens=settings.max_new_tokens,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            output_formatter=settings.output_formatter,
            tgi_compat=settings.tgi_compat,
        )

    @property
    def dynamic_batching(self) -> bool:
        return self.settings.dynamic_batching

    def ready_engine(self):
        if self.status != self.READY:
            raise ModelNotReady(f"Model {self.name} is {'loading' if self.status == self.PENDING else 'failed'}")
        return self.engine

    async def load(self) -> None:
        try:
            await asyncio.to_thread(self._load_blocking)
            self.engine.start()
            self.status = self.READY
            log.info("model %s ready (%s on %s)", self.name, self.path, self.loaded.device)
        except Exception as exc:  # noqa: BLE001 - reported by /ping and the log
            self.status, self.error = self.FAILED, str(exc)
            log.error("model %s failed to load: %s", self.name, exc)

    def _load_blocking(self) -> None:
        from lmiserve.engine.factory import build_engine
        from lmiserve.models import default_model_name, load_causal_lm, resolve_model_path

        s = self.settings
        self.path = resolve_model_path(s.model_id, s.revision, s.model_cache_dir)
        if not s.model_name:
            self.name = default_model_name(s.model_id, self.path)
        self.loaded = load_causal_lm(self.path, dtype=s.dtype, device=s.device, trust_remote_code=s.trust_remote_code)
        self.engine = build_engine(self.loaded, s)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.stop()


def _initial_name(model_id: str | None) -> str:
    from lmiserve.models import default_model_name

    return default_model_name(model_id, None)


def model_service(request, name: str | None = None) -> ModelService:
    """The model a request addresses by name, else the default one; ModelNotFound for an unknown name.

    Every route resolves its model through here (or `default_llm`), so how models are held is one place.
    """
    from lmiserve.core.errors import ModelNotFound

    service: ModelService = request.app.state.service
    if name and name != service.name:
        raise ModelNotFound(f"Model or workflow not found: {name}")
    return service


def default_llm(request) -> ModelService:
    """The generative model that name-less routes (TGI, OpenAI, plain /invocations) talk to."""
    return model_service(request)
