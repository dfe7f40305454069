"""One served model: loads in the background, then owns its engine. /ping and /models read its state.

`kind` says what it is (models/kinds.py): an `llm` runs on the continuous-batching AsyncEngine; the
one-shot kinds (`embedding`, `classifier`, `torchscript`) run on a dynamic batcher. Either way
`tensor_model` is the `TensorModel` every tensor protocol calls.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from lmiserve.protocols.lmi.parse import Limits
from lmiserve.config import Settings
from lmiserve.engine import torch_thread
from lmiserve.core.errors import ModelNotReady

log = logging.getLogger(__name__)

# One model loads at a time: transformers' lazy imports are not safe to race from several threads,
# and on a few CPU cores parallel loads gain nothing.
_LOAD_LOCK = threading.Lock()


class ModelService:
    PENDING, READY, FAILED = "PENDING", "READY", "FAILED"

    def __init__(self, settings: Settings, *, name: str | None = None, kind: str | None = None):
        from lmiserve.models.kinds import detect_kind

        self.settings = settings
        self.status = self.PENDING
        self.error: str | None = None
        self.path: Path | None = None
        self.loaded = None
        self.engine = None
        self._tensor_model = None
        self._closed = False
        self.started_at = time.time()
        self.loaded_at_startup = True
        self.name = name or settings.model_name or _initial_name(settings.model_id)
        self._fixed_name = bool(name or settings.model_name)
        self.kind = kind or detect_kind(settings.model_id, settings.model_kind)
        self.limits = Limits(
            default_max_new_tokens=settings.max_new_tokens,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            output_formatter=settings.output_formatter,
            tgi_compat=settings.tgi_compat,
        )

    @property
    def is_llm(self) -> bool:
        return self.kind == "llm"

    @property
    def dynamic_batching(self) -> bool:
        return self.settings.dynamic_batching

    def ready_engine(self):
        if self.status != self.READY:
            raise ModelNotReady(f"Model {self.name} is {'loading' if self.status == self.PENDING else 'failed'}")
        return self.engine

    @property
    def tensor_model(self):
        """The `TensorModel` of this model (ModelNotReady until it is loaded)."""
        self.ready_engine()
        return self._tensor_model

    async def load(self) -> None:
        try:
            await torch_thread.run_apart(self._load_blocking)
            if self._closed:  # unregistered while loading: never start
                self.status, self.error = self.FAILED, "unloaded while loading"
                return
            self.engine.start()
            self.status = self.READY
            log.info("model %s (%s) ready (%s)", self.name, self.kind, self.path)
        except Exception as exc:  # noqa: BLE001 - reported by /ping and the log
            self.status, self.error = self.FAILED, str(exc)
            log.error("model %s failed to load: %s", self.name, exc)

    def _load_blocking(self) -> None:
        with _LOAD_LOCK:
            self._load_locked()

    def _load_locked(self) -> None:
        if self.is_llm:
            self._load_llm()
        else:
            self._load_oneshot()

    def _load_llm(self) -> None:
        from lmiserve.models.llm_tensor import LlmTensorModel
        from lmiserve.engine.factory import build_engine
        from lmiserve.models import default_model_name, load_causal_lm, resolve_model_path

        s = self.settings
        self.path = resolve_model_path(s.model_id, s.revision, s.model_cache_dir)
        if not self._fixed_name:
            self.name = default_model_name(s.model_id, self.path)
        self.loaded = load_causal_lm(self.path, dtype=s.dtype, device=s.device, trust_remote_code=s.trust_remote_code)
        self.engine = build_engine(self.loaded, s)
        self._tensor_model = LlmTensorModel(self.engine, self.limits, self.name)

    def _load_oneshot(self) -> None:
        from lmiserve.engine.oneshot import BatchConfig, OneShotModel
        from lmiserve.models.tensor_models import load_runner

        s = self.settings
        runner = load_runner(self.kind, s)
        self.path, self.loaded, self.kind = runner.path, runner, runner.kind  # classifier -> regression for one-label heads
        config = BatchConfig(batch_size=s.batch_size, max_batch_delay=s.max_batch_delay / 1000.0, job_queue_size=s.job_queue_size)
        self.engine = OneShotModel(runner, config, self.name)
        self._tensor_model = self.engine

    async def close(self) -> None:
        self._closed = True
        if self.engine is not None:
            await self.engine.stop()


def _initial_name(model_id: str | None) -> str:
    from lmiserve.models import default_model_name

    return default_model_name(model_id, None)


def _registry(request):
    return request.app.state.registry


def model_service(request, name: str | None = None) -> ModelService:
    """The model a request addresses by name, else the default one; ModelNotFound for an unknown name.

    Every route resolves its model through here (or `default_llm` / `tensor_model`), so how models are
    held is one place (models/registry.py).
    """
    return _registry(request).get(name) if name else _registry(request).default()


def default_llm(request) -> ModelService:
    """The generative model that name-less routes (TGI, OpenAI, plain /invocations) talk to."""
    return _registry(request).default_llm()


def tensor_model(request, name: str | None = None):
    """The `TensorModel` of the named (or default) model; ModelNotFound / ModelNotReady as they apply."""
    return model_service(request, name).tensor_model
