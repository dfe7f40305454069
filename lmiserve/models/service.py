"""One served model: loads in the background, then owns its engine. /ping and /models read its state.

`kind` says what it is (models/kinds.py): an `llm` runs on the continuous-batching AsyncEngine; the
one-shot kinds (`embedding`, `classifier`, `torchscript`) run on a dynamic batcher. Either way
`tensor_model` is the `TensorModel` every tensor protocol calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lmiserve.config import Settings
from lmiserve.core import heap
from lmiserve.core.engine import ModelEngine, TextGenerator
from lmiserve.core.errors import ModelNotReady, Unsupported
from lmiserve.core.parameters import Limits
from lmiserve.core.stats import EngineObserver
from lmiserve.core.tensors import TensorModel
from lmiserve.engine import torch_thread

if TYPE_CHECKING:
    from lmiserve.engine.loaded import LoadedModel
    from lmiserve.engine.lora.registry import Adapters
    from lmiserve.oneshot.batcher import TensorRunner

log = logging.getLogger(__name__)

# One model loads at a time: transformers' lazy imports are not safe to race from several threads,
# and on a few CPU cores parallel loads gain nothing.
_LOAD_LOCK = threading.Lock()


def engine_process_wanted(settings: Settings) -> bool:
    """Whether an LLM's engine runs in a process of its own: `engine_process` where it is set, else where the
    model is served on a GPU (the setting's description says why; logged)."""
    if settings.engine_process is not None:
        return settings.engine_process
    from lmiserve.models.load import resolve_device

    wanted = resolve_device(settings.device).type == "cuda"
    if wanted:
        log.info("the engine runs in a process of its own (engine_process unset: on for a GPU; docs/engine.md)")
    return wanted


class ModelService:
    PENDING, READY, FAILED = "PENDING", "READY", "FAILED"

    def __init__(self, settings: Settings, *, name: str | None = None, kind: str | None = None) -> None:
        from lmiserve.models.kinds import detect_kind

        self.settings = settings
        self.status = self.PENDING
        self.error: str | None = None
        self.path: Path | None = None
        self.loaded: LoadedModel | TensorRunner | None = None  # the LLM, or the one-shot model's runner
        self.engine: ModelEngine | None = None  # the AsyncEngine of an LLM, else the OneShotModel
        self._generator: TextGenerator | None = None  # the AsyncEngine of an LLM
        self._llm: LoadedModel | None = None  # the loaded causal LM of an LLM
        self._tensor_model: TensorModel | None = None
        self._closed = False
        self.observers: list[EngineObserver] = []  # handed to the engine of an LLM when it is built
        # told when the loaded LLM's engine fails for good (lmiserve serve exits non-zero then)
        self.on_engine_failed: list[Callable[[ModelService], None]] = []
        self.started_at = time.time()
        self.loaded_at_startup = True
        self.download_failed = False  # the model failed to load because it could not be fetched
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

    def ready_engine(self) -> ModelEngine | None:
        """The engine of the loaded model; ModelNotReady while it loads or after it failed. (None only for
        a service put together without one, as tests do with bare tensor models.)"""
        if self.status != self.READY:
            raise ModelNotReady(f"Model {self.name} is {'loading' if self.status == self.PENDING else 'failed'}")
        return self.engine

    def ready_llm(self) -> LoadedModel:
        """The loaded causal LM (tokenizer, device, dtype); ModelNotReady while it loads, Unsupported for
        other kinds."""
        self.ready_engine()
        if self._llm is None:
            raise Unsupported(f"Model {self.name} is a {self.kind} model; it does not generate text")
        return self._llm

    def ready_generator(self) -> TextGenerator:
        """The text generator of a loaded LLM; ModelNotReady while it loads, Unsupported for other kinds."""
        self.ready_engine()
        if self._generator is None:
            raise Unsupported(f"Model {self.name} is a {self.kind} model; it does not generate text")
        return self._generator

    @property
    def adapters(self) -> Adapters | None:
        """The LoRA adapters of a loaded LLM served with `enable_lora` (None otherwise)."""
        return getattr(self._generator, "adapters", None)

    @property
    def tensor_model(self) -> TensorModel:
        """The `TensorModel` of this model (ModelNotReady until it is loaded)."""
        self.ready_engine()
        if self._tensor_model is None:
            raise ModelNotReady(f"Model {self.name} is not loaded")
        return self._tensor_model

    async def load(self) -> None:
        from lmiserve.engine.core.async_engine import AsyncEngine
        from lmiserve.engine.core.warmup import warm_up

        try:
            engine = await torch_thread.run_apart(self._load_blocking)
            if self._closed:  # unregistered while loading: never start (an engine process is stopped)
                self.status, self.error = self.FAILED, "unloaded while loading"
                await engine.stop()
                return
            engine.start()
            if isinstance(engine, AsyncEngine):  # on a GPU: each shape run once before the first request
                await warm_up(engine)
            heap.freeze()  # what loading left alive stays out of the collector's way (core/heap.py)
            self.status = self.READY
            log.info("model %s (%s) ready (%s)", self.name, self.kind, self.path)
        except Exception as exc:  # noqa: BLE001 - reported by /ping and the log
            from lmiserve.models.download import DownloadError

            self.download_failed = isinstance(exc, DownloadError)
            self.status, self.error = self.FAILED, str(exc) or type(exc).__name__
            log.error("model %s failed to load: %s", self.name, self.error_summary)
            log.debug("model %s failed to load", self.name, exc_info=exc)

    @property
    def error_summary(self) -> str:
        """`error` on one line: its first paragraph (transformers appends advice after a blank line)."""
        first = (self.error or "").strip().split("\n\n", 1)[0]
        return " ".join(first.split())

    def _load_blocking(self) -> ModelEngine:
        model_id = self._fetch()  # outside the lock: other models load while this one downloads
        with _LOAD_LOCK:
            return self._load_llm(model_id) if self.is_llm else self._load_oneshot(model_id)

    def _fetch(self) -> str | None:
        """The local model of `model_id`: a Hub id or an s3:// / gs:// URL is fetched now (models/download),
        and its kind detected from the files that came; anything else is returned as it is."""
        from lmiserve.models.download import FetchOptions, fetch, is_remote
        from lmiserve.models.kinds import detect_kind

        s = self.settings
        if not is_remote(s.model_id):
            return s.model_id
        assert s.model_id is not None
        local = fetch(s.model_id, FetchOptions.from_settings(s))
        self.kind = detect_kind(str(local), s.model_kind)
        return str(local)

    def _load_llm(self, model_id: str | None) -> ModelEngine:
        from lmiserve.models import default_model_name, resolve_model_path
        from lmiserve.models.compose import load_served_llm

        s = self.settings
        self.path = resolve_model_path(model_id, s.revision, s.model_cache_dir)
        if not self._fixed_name:
            self.name = default_model_name(s.model_id, self.path)
        if engine_process_wanted(s):  # the engine core in a process of its own (engine/process/), its workers too
            from lmiserve.models.engine_process import start_engine_process

            loaded, client = start_engine_process(s, self.path, self.name)  # its adapters registered there
            self.attach_llm(loaded, client)
            return client
        loaded, engine = load_served_llm(s, self.path, self.name)
        self.attach_llm(loaded, engine)
        return engine

    def attach_llm(self, loaded: LoadedModel, generator: TextGenerator) -> None:
        """Serve `generator` as this LLM's engine, over `loaded` (its tokenizer, device, dtype, context):
        what loading does once the model is in memory (the observers of the metrics are added to it, the
        tensor protocols get its `LlmTensorModel`). The status is left as it is: `load` sets READY once
        the engine started. Tests attach a fake generator over a real tokenizer this way."""
        from lmiserve.media import media_limits
        from lmiserve.models.llm_tensor import LlmTensorModel

        self.loaded = self._llm = loaded
        self.engine = self._generator = generator
        for observer in self.observers:
            generator.add_observer(observer)
        listeners = getattr(generator, "on_failure", None)
        if isinstance(listeners, list):
            listeners.append(self._engine_failed)
        processor = getattr(loaded, "processor", None)  # a vision-language model's: the `image` input
        media = media_limits(self.settings) if processor is not None else None
        self._tensor_model = LlmTensorModel(generator, self.limits, self.name, processor=processor, media=media)

    def _engine_failed(self, reason: str) -> None:
        """The LLM's engine failed for good: the model is FAILED (/ping and the ready probes answer 503)."""
        self.status, self.error = self.FAILED, reason
        log.error("model %s: %s", self.name, reason)
        for listener in self.on_engine_failed:
            listener(self)

    def _load_oneshot(self, model_id: str | None) -> ModelEngine:
        from lmiserve.models.tensor_models import load_runner
        from lmiserve.oneshot.batcher import BatchConfig, OneShotModel

        s = self.settings
        if s.engine_process:  # said, not silently dropped: only a generative model's engine has a process
            log.warning(
                "engine_process applies to LLMs: the %s model %s runs in the server's process", self.kind, self.name
            )
        runner = load_runner(self.kind, s, model_id)
        self.path, self.loaded, self.kind = (
            runner.path,
            runner,
            runner.kind,
        )  # classifier -> regression for one-label heads
        config = BatchConfig(
            batch_size=s.batch_size, max_batch_delay=s.max_batch_delay / 1000.0, job_queue_size=s.job_queue_size
        )
        engine = OneShotModel(runner, config, self.name)
        self.engine = self._tensor_model = engine
        return engine

    async def close(self) -> None:
        self._closed = True
        if self.engine is not None:
            await self.engine.stop()
        heap.thaw()  # what this model held may now be collected (core/heap.py)


def run_worker_node(settings: Settings) -> int:
    """`lmiserve serve` on a node other than the leader (`node_rank` > 0): this node's tensor-parallel
    workers only, no HTTP; the exit status of `executors.tensor_parallel.run_node`."""
    from lmiserve.engine.executors.tensor_parallel import run_node
    from lmiserve.models import resolve_model_path
    from lmiserve.models.compose import tensor_parallel_degree, worker_spec
    from lmiserve.models.download import FetchOptions
    from lmiserve.models.load import resolve_device

    options = FetchOptions.from_settings(settings)
    path = resolve_model_path(settings.model_id, settings.revision, settings.model_cache_dir, options)
    device = resolve_device(settings.device)
    return run_node(worker_spec(settings, str(path), device, tensor_parallel_degree(settings, device)))


def _initial_name(model_id: str | None) -> str:
    from lmiserve.models import default_model_name

    return default_model_name(model_id, None)
