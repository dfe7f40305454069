"""The engine of a served model, from the settings: the composition above the engine.

The engine (lmiserve/engine/) takes plain values: a `LoadedModel`, an `EngineConfig`, a `WorkerSpec`
whose loaders its tensor-parallel workers call. Here the settings (lmiserve.config) and the model loading
(models/load.py) meet it: `engine_config` reads the settings into an `EngineConfig` (warning about those
that do not apply), `build_engine` builds the engine of a loaded model, `build_tensor_parallel_engine`
the engine over tensor-parallel workers, `load_llm` the model and its engine in the process that runs
them (`load_tensor_parallel_llm` the same over tensor-parallel workers; `load_served_llm` whichever the
settings ask for, its start adapters registered, in the server's process or its engine process:
models/engine_process.py), `worker_spec` what those workers
need (`lmiserve serve` on a node other than the leader runs them alone: `models.service.run_worker_node`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.config.sources import ENV_SHORTCUTS
from lmiserve.engine.codecs import prompt_codec
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.executors.tensor_parallel import TensorParallelExecutor, WorkerSpec, free_port
from lmiserve.engine.executors.tp_worker import DraftLoad
from lmiserve.engine.factory import create_engine, worker_config
from lmiserve.engine.lora.registry import AdapterRegistry, LoraLimits
from lmiserve.engine.model.shard_checkpoint import checkpoint_files
from lmiserve.engine.model.sharding import unsplittable_reason
from lmiserve.engine.runner import fast_path_modules
from lmiserve.engine.runner.vision import is_vision_model
from lmiserve.engine.speculative.proposers import SpeculationSettings
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm, load_model_shell, resolve_dtype
from lmiserve.models.quantized_load import checkpoint_quantization, quantize_at_load

if TYPE_CHECKING:
    from lmiserve.config import Settings
    from lmiserve.engine.loaded import LoadedModel

log = logging.getLogger(__name__)


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's options from the settings (what depends on the device is resolved by `create_engine`)."""
    if "prefix_cache_size" in settings.model_fields_set:
        log.warning(
            "prefix_cache_size is ignored: the KV pool (kv_cache_memory_bytes) is the prefix cache "
            "(enable_prefix_caching=false turns it off)"
        )
    degree = settings.tensor_parallel_degree
    if degree is None or degree == "1":
        # set on purpose (not a launcher's MASTER_ADDR/MASTER_PORT, which other tools export too)
        launcher = {f"environment {var}" for var, _ in ENV_SHORTCUTS}
        unused = [
            f"{key} ({settings.sources[key]})"
            for key in ("master_addr", "master_port", "step_timeout")
            if key in settings.sources and settings.sources[key] not in launcher
        ]
        if unused:
            log.warning("%s: only for tensor parallelism (tensor_parallel_degree > 1); ignored", ", ".join(unused))
    if settings.async_scheduling and settings.speculative_config is not None:
        log.warning(
            "async_scheduling=true with speculative_config: each step is planned after the step before it "
            "(its drafts come from that step); overlap scheduling does not apply"
        )
    static = settings.dynamic_batching
    return EngineConfig(
        max_running=settings.batch_size if static else settings.max_rolling_batch_size,
        max_prefill_tokens=settings.max_rolling_batch_prefill_tokens,
        max_step_tokens=settings.max_num_batched_tokens,
        job_queue_size=settings.job_queue_size,
        predict_timeout=settings.predict_timeout,
        static_batching=static,
        batch_size=settings.batch_size,
        max_batch_delay=settings.max_batch_delay / 1000.0,
        batch_invariant=settings.batch_invariant,
        fast_path=settings.fast_path,
        cpu_autotune=settings.cpu_autotune,
        autotune_cache=settings.autotune_cache,
        prefill_floor=settings.prefill_tokens_while_decoding or "auto",
        enable_prefix_caching=settings.enable_prefix_caching,
        kv_cache_memory_bytes=int(settings.kv_cache_memory_bytes) if settings.kv_cache_memory_bytes else None,
        block_size=settings.block_size,
        stream_interval=settings.stream_interval,
        kv_cache_dtype=settings.kv_cache_dtype,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
        graph_prompt_tokens=settings.cuda_graph_prompt_tokens,
        async_scheduling=settings.async_scheduling,
        speculation=speculation_settings(settings),
        lora=LoraLimits(settings.max_loras, settings.max_lora_rank, settings.max_cpu_loras)
        if settings.enable_lora
        else None,
    )


def speculation_settings(settings: Settings) -> SpeculationSettings | None:
    """The engine's speculative decoding from `speculative_config` (None: off)."""
    spec = settings.speculative_config
    if spec is None:
        return None
    base = SpeculationSettings(
        "draft_model",
        spec.num_speculative_tokens,
        disable_by_batch_size=spec.disable_by_batch_size,
        min_acceptance_rate=spec.min_acceptance_rate,
    )
    if spec.method == "ngram":
        # its bounds are completed by the validator (a draft model has none)
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return dataclasses.replace(
            base, method="ngram", prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max
        )
    target = settings.model_id or "the bundled model"
    draft_name = f"{target} as {spec.dtype}" if spec.self_draft else f"{spec.model} ({spec.dtype})"
    return dataclasses.replace(base, draft_name=draft_name)


def build_engine(loaded: LoadedModel, settings: Settings, draft: LoadedModel | None = None) -> AsyncEngine:
    """The engine of `loaded` (and of its speculative decoding's `draft` model, when it has one)."""
    return create_engine(loaded, engine_config(settings), max_input_len=settings.max_input_len, draft=draft)


# ---- tensor parallelism (engine/executors/tensor_parallel.py) --------------------------------------------------------
def tensor_parallel_degree(settings: Settings, device: torch.device) -> int:
    """The ranks `tensor_parallel_degree` asks for (`max`: the visible GPUs on CUDA, 1 on a CPU); on CUDA a
    node must see a GPU for each of its ranks."""
    degree = settings.tensor_parallel_degree
    if degree is None:
        return 1
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if degree == "max":  # one node (settings refuse max with several)
        ranks = max(1, visible)
        conflict = settings.tensor_parallel_conflict(ranks) if ranks > 1 else None
        if conflict is not None:
            raise ValueError(f"{conflict} (tensor_parallel_degree=max: the {ranks} visible GPUs)")
        return ranks
    ranks = int(degree)
    local = ranks // settings.nnodes
    if device.type == "cuda" and ranks > 1 and device.index is not None:
        raise ValueError(
            f"tensor_parallel_degree={ranks} runs rank i on cuda:i of the visible GPUs: give device=cuda (choose "
            f"the GPUs with CUDA_VISIBLE_DEVICES), not {device}"
        )
    if device.type == "cuda" and ranks > 1 and local > visible:
        raise ValueError(
            f"tensor_parallel_degree={ranks} needs {local} GPUs on each of {settings.nnodes} node(s); "
            f"this node sees {visible}"
        )
    return ranks


def worker_spec(settings: Settings, model_path: str, device: torch.device, degree: int) -> WorkerSpec:
    """What `degree` workers of `model_path` on `device` need (the engine's options among them, and the
    loaders they read the model with)."""
    config = worker_config(engine_config(settings), device, degree // settings.nnodes)
    quant = checkpoint_quantization(Path(model_path), settings.quantize, settings.load_format)
    if quant is not None and quant.source not in ("dynamic", "dummy") and checkpoint_files(model_path) is None:
        raise ModelLoadError(f"a {quant.method} checkpoint needs its weights as safetensors")
    port = settings.master_port or (29500 if settings.nnodes > 1 else free_port())
    draft = None
    spec = settings.speculative_config
    if spec is not None and spec.method != "ngram":  # fetched here once (a Hub id, s3://, gs://); every rank loads it
        from lmiserve.models import resolve_model_path
        from lmiserve.models.download import adapter_options

        path = (
            model_path
            if spec.self_draft
            else str(resolve_model_path(spec.model, None, settings.model_cache_dir, adapter_options(settings)))
        )
        draft = DraftLoad(path, spec.dtype, settings.load_format if spec.self_draft else "auto")
    return WorkerSpec(
        model_path=model_path,
        dtype=str(resolve_dtype(settings.dtype, device)).removeprefix("torch."),
        device=device.type,
        load_format=settings.load_format,
        trust_remote_code=settings.trust_remote_code,
        world=degree,
        config=config,
        load_model=load_causal_lm,
        load_shell=load_model_shell,
        quantize_shard=quantize_at_load,
        nnodes=settings.nnodes,
        node_rank=settings.node_rank,
        master_addr=settings.master_addr,
        master_port=port,
        step_timeout=settings.step_timeout,
        log_level=settings.log_level.upper(),
        quantization=quant,
        draft=draft,
    )


def build_tensor_parallel_engine(loaded: LoadedModel, settings: Settings, degree: int) -> AsyncEngine:
    """The engine of `loaded` (its tokenizer and config; no weights: `models.load.load_model_shell`) over
    `degree` tensor-parallel workers: the model's shape is checked here, before any worker starts. With
    `enable_lora` its adapter registry checks adapters against the shell (their weights are the workers':
    each rank reads its shard of one, engine/executors/tensor_parallel.py)."""
    reason = unsplittable_reason(loaded.model.config, degree)
    if reason is not None:
        raise ValueError(reason)
    spec = worker_spec(settings, str(loaded.path), loaded.device, degree)
    if is_vision_model(loaded.model):
        _refuse_for_a_vlm(spec)
    adapters = None
    if spec.config.lora is not None:
        # (lmiserve's forward adapts no mixture of experts' MLP, and no other forward runs a shard)
        adapters = AdapterRegistry(loaded.model, spec.config.lora, modules=fast_path_modules(loaded.model))
    executor = TensorParallelExecutor(spec)
    codec, grammars = prompt_codec(loaded, settings.max_input_len)
    sizes = executor.graph_sizes  # (the warm-up captures each decode graph on every rank, before serving)
    rows = tuple(sorted({min(s, spec.config.max_running) for s in sizes})) if sizes else (1,)
    return AsyncEngine(executor, codec, spec.config, grammars, adapters, rows)


def _refuse_for_a_vlm(spec: WorkerSpec) -> None:
    """What tensor parallelism does not serve with a vision-language model, refused in one line (ValueError)."""
    if spec.draft is not None:
        raise ValueError(
            "speculative decoding with a draft model is not served with a vision-language model (prompt lookup, "
            "method ngram, is)"
        )


ADAPTERS_FOLDER = "adapters"  # next to the model: LoRA adapters registered at start (LMI's layout)


def register_start_adapters(adapters: AdapterRegistry, settings: Settings, path: Path, name: str) -> None:
    """The adapters named at start (`lora_modules`, `lora_adapters`) and those in the `adapters/` folder
    next to the model in `path` (LMI's layout: one adapter a subfolder), loaded now, the model's `name`
    reserved: one that does not load stops the start, naming it."""
    from lmiserve.models.download import adapter_options, fetch, is_remote

    adapters.reserved.add(name)
    pairs = settings.start_adapters()
    folder = (path if path.is_dir() else path.parent) / ADAPTERS_FOLDER
    if folder.is_dir():
        named = {n for n, _ in pairs}
        pairs += [
            (sub.name, str(sub))
            for sub in sorted(folder.iterdir())
            if sub.is_dir() and (sub / "adapter_config.json").is_file() and sub.name not in named
        ]
    for adapter, source in pairs:
        if is_remote(source):  # a Hub id, s3:// or gs:// URL: fetched now, as the model was
            source = str(fetch(source, adapter_options(settings)))
        try:
            adapters.register(adapter, source, preload=True)
        except (ValueError, FileExistsError) as exc:
            raise ValueError(f"adapter {adapter} ({source}) cannot be served: {exc}") from None


def load_tensor_parallel_llm(settings: Settings, path: Path, degree: int) -> tuple[LoadedModel, AsyncEngine]:
    """The LLM in `path` over `degree` tensor-parallel workers (started here): this process holds the
    model's shell (its tokenizer and config, no weights) and the engine (not started)."""
    s = settings
    loaded = load_model_shell(path, s.dtype, s.device, s.trust_remote_code)
    with_chat_template(loaded.tokenizer, s.chat_template)
    return loaded, build_tensor_parallel_engine(loaded, s, degree)


def load_served_llm(settings: Settings, path: Path, name: str) -> tuple[LoadedModel, AsyncEngine]:
    """The LLM in `path` as it is served, in the process that runs its engine (the server's, or its engine
    process): over tensor-parallel workers where the settings ask for more than one rank
    (`load_tensor_parallel_llm`), else `load_llm`; with LoRA, the adapters named at start registered and the
    model's `name` reserved (`register_start_adapters`)."""
    from lmiserve.models.load import resolve_device

    degree = tensor_parallel_degree(settings, resolve_device(settings.device))
    loaded, engine = load_tensor_parallel_llm(settings, path, degree) if degree > 1 else load_llm(settings, path)
    if engine.adapters is not None:
        try:
            register_start_adapters(engine.adapters, settings, path, name)
        except BaseException:
            engine.executor.close()  # tensor-parallel workers started: stop them
            raise
    return loaded, engine


def load_llm(settings: Settings, path: Path) -> tuple[LoadedModel, AsyncEngine]:
    """The LLM in `path` loaded on its device, with its draft model when speculative decoding has one, and
    its engine (not started): what serving it takes in the process that runs it."""
    from lmiserve.models import resolve_model_path
    from lmiserve.models.download import adapter_options

    s = settings
    loaded = load_causal_lm(
        path,
        dtype=s.dtype,
        device=s.device,
        trust_remote_code=s.trust_remote_code,
        load_format=s.load_format,
        quantize=s.quantize,
    )
    with_chat_template(loaded.tokenizer, s.chat_template)
    draft = None
    spec = s.speculative_config
    if spec is not None and spec.method != "ngram":
        draft_path = (
            path if spec.self_draft else resolve_model_path(spec.model, None, s.model_cache_dir, adapter_options(s))
        )
        draft = load_causal_lm(
            draft_path,
            dtype=spec.dtype,
            device=s.device,
            trust_remote_code=s.trust_remote_code,
            load_format=s.load_format if spec.self_draft else "auto",
        )
    return loaded, build_engine(loaded, s, draft)


def with_chat_template(tokenizer: Any, template: str | None) -> None:
    """The `chat_template` setting (a Jinja file's path, or the template text) in place of the tokenizer's."""
    if not template:
        return
    path = Path(template).expanduser()
    try:
        is_file = "\n" not in template and "{" not in template and path.is_file()
    except OSError:  # a template text too long to be a path
        is_file = False
    if is_file:
        text = path.read_text(encoding="utf-8")
    elif "{" in template:
        text = template
    else:
        raise ModelLoadError(f"chat_template: {template} is neither a readable file nor a Jinja template")
    tokenizer.chat_template = text
    log.info("chat template from the chat_template setting (%s)", path if is_file else "its text")
