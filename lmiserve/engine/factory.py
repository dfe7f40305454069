"""Build the engine for a loaded model from the server settings."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.config.sources import ENV_SHORTCUTS
from lmiserve.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from lmiserve.core.request import SamplingParams
from lmiserve.engine import cuda_graphs, lora_kernels
from lmiserve.engine.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.grammar_compiler import GrammarCompiler
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.lora import FAST_PATH_MODULES
from lmiserve.engine.lora_registry import AdapterRegistry, LoraLimits
from lmiserve.engine.quantize import Int4Linear, Int8Linear, quantize_output_int8
from lmiserve.engine.runners import FastRunner, ModelRunner, create_runner, paged_generic, runner_class
from lmiserve.engine.runners.batched import PersistentBatchRunner
from lmiserve.engine.runners.paged import PagedFastRunner, kv_bytes_per_block
from lmiserve.engine.speculative import DraftModelProposer, NgramProposer, Proposer, SpeculationSettings
from lmiserve.engine.step import BatchRunner, NewRequest, ScheduledTokens, StepBatch
from lmiserve.engine.tensor_parallel import unsplittable_reason
from lmiserve.engine.tokenizer import HfTokenizer
from lmiserve.engine.tp_workers import TensorParallelExecutor, WorkerSpec, free_port
from lmiserve.engine.validation import PromptCodec

if TYPE_CHECKING:
    from lmiserve.config import Settings

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.25  # of the memory available at start-up: the paged KV pool's default budget on CPU
GPU_ACTIVATION_RESERVE = 2 * 2**30  # bytes left for activations beside the paged KV pool on CUDA


def available_memory() -> int:
    """Bytes of RAM available now (Linux's MemAvailable; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_pool_blocks(
    loaded: LoadedModel, config: EngineConfig, activation_bytes: int | None = None, graphs: bool = False
) -> int:
    """Blocks of the paged KV pool: the budget (`kv_cache_memory_bytes`, else by device) over a block's
    bytes, never more than `max_running` sequences at full context need, at least one. On CUDA the budget
    is `gpu_memory_utilization` of the GPU less what is allocated (the weights) and less the activations of
    the largest step: `activation_bytes` as profiled (`profile_step_memory`, with a margin), else a fixed
    `GPU_ACTIVATION_RESERVE`; with decode `graphs`, less their memory too (`graph_pool_bytes`)."""
    per_block = kv_bytes_per_block(loaded.model, config.block_size)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        device = loaded.device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            budget = int(config.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device)
            reserve = GPU_ACTIVATION_RESERVE
            if activation_bytes is not None:
                reserve = int(activation_bytes * PROFILE_MARGIN) + PROFILE_SLACK
            if graphs:
                reserve += graph_pool_bytes(
                    activation_bytes or 0,
                    largest_step_tokens(config, loaded.max_context),
                    cuda_graphs.capture_sizes(config.max_running)[-1],
                    int(loaded.model.config.vocab_size),
                    loaded.model.dtype.itemsize,
                )
            budget -= reserve
        else:
            budget = int(available_memory() * CPU_KV_SHARE)
    full_batch = config.max_running * -(-loaded.max_context // config.block_size)
    return max(1, min(budget // per_block, full_batch))


# the profiled activations are grown by this factor and this many bytes (allocator fragmentation, the
# sampler's own tensors) before the KV pool takes the rest of gpu_memory_utilization
PROFILE_MARGIN = 1.2
PROFILE_SLACK = 256 * 2**20


def graph_pool_bytes(step_bytes: int, step_tokens: int, rows: int, vocab: int, itemsize: int) -> int:
    """The memory the captured decode graphs keep (engine/cuda_graphs.py: one pool for all, the largest
    capture size's step): the profiled step's activations scaled to `rows` tokens, with the margin, and
    that step's logits (every row's, in the model's dtype and in float32)."""
    activations = step_bytes * rows // max(1, step_tokens)
    return int(activations * PROFILE_MARGIN) + rows * vocab * (itemsize + 4)


def largest_step_tokens(config: EngineConfig, max_context: int) -> int:
    """The most tokens one step computes: the prefill budget and a decode row for every other sequence."""
    return min(config.max_prefill_tokens + config.max_running, max_context)


def run_profile_step(runner_of: Callable[[int], BatchRunner], tokens: int, block_size: int) -> int:
    """Run one step of a `tokens`-token prompt on a runner made by `runner_of(blocks)` over just enough
    blocks, as the largest step the scheduler plans would (every layer's activations at their widest);
    the bytes of that runner's pool. The runner is dropped after."""
    blocks = -(-tokens // block_size)
    runner = runner_of(blocks)
    ids = [0] * tokens
    params = SamplingParams(max_new_tokens=1)
    batch = StepBatch(
        rows=[ScheduledTokens(0, 0, ids, list(range(blocks)), sample=True)],
        new=[NewRequest(0, ids, params, seed=0)],
    )
    output = runner.execute_batch(batch)
    if output.errors:
        raise RuntimeError(f"the profiling step failed: {next(iter(output.errors.values()))}")
    runner.execute_batch(StepBatch(finished=[0]))
    return int(getattr(runner, "kv_bytes", 0))


def profile_step_memory(
    device: torch.device, runner_of: Callable[[int], BatchRunner], tokens: int, block_size: int
) -> int | None:
    """On CUDA, the peak memory the largest step needs beyond what is allocated before it and beyond its
    pool (`run_profile_step`): what the KV pool must leave free (vLLM sizes its pool after such a run).
    None on other devices, or when the profiling step fails (logged; the fixed reserve is used)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        pool = run_profile_step(runner_of, tokens, block_size)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before - pool
    except Exception:  # noqa: BLE001 - a failed profile costs the pool's precision, not the start
        log.exception("profiling the largest step failed; the KV pool leaves the fixed activation reserve")
        return None
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    log.info("profiled the largest step (%d tokens): %.2f GiB of activations", tokens, peak / 2**30)
    return max(0, int(peak))


# Rows from which speculative decoding stops drafting, by device, unless disable_by_batch_size says:
# on CPU a step of a few rows still costs about the weights it reads (benchmarks/README.md).
DISABLE_BY_BATCH_SIZE = {"cpu": DEFAULT_DISABLE_BY_BATCH_SIZE, "cuda": 32}

# Prompt tokens a step that also decodes may take at least (it takes max(floor, decoding rows)).
# CPU: a step's cost is ~ weight read + tokens x per-token compute; 16 extra tokens at most double
# a 1-row decode step and add ~1/3 to a 32-row one (benchmarks/README.md, "prefill budget").
# GPU: a step costs about the same up to hundreds of tokens (not measured here).
PREFILL_FLOOR = {"cpu": 16, "cuda": 256}


def engine_config(settings: Settings) -> EngineConfig:
    if settings.kv_cache == "paged" and "prefix_cache_size" in settings.model_fields_set:
        log.warning(
            "prefix_cache_size sizes the slot cache's prefix cache only: with kv_cache=paged the KV pool "
            "(kv_cache_memory_bytes) is the prefix cache"
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
    static = settings.dynamic_batching
    return EngineConfig(
        max_running=settings.batch_size if static else settings.max_rolling_batch_size,
        max_prefill_tokens=settings.max_rolling_batch_prefill_tokens,
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
        prefix_cache_bytes=int(settings.prefix_cache_size) if settings.enable_prefix_caching else 0,
        kv_cache=settings.kv_cache,
        kv_cache_memory_bytes=int(settings.kv_cache_memory_bytes) if settings.kv_cache_memory_bytes else None,
        block_size=settings.block_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enforce_eager=settings.enforce_eager,
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


def create_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    max_input_len: int | None = None,
    runner_cls: type[ModelRunner] | None = None,
    draft: LoadedModel | None = None,
) -> AsyncEngine:
    """The engine for `loaded`; the runner strategy follows `config` unless `runner_cls` is given;
    `draft`: the draft model of `config.speculation` (method draft_model)."""
    config = _for_device(config, loaded.device)
    spec = config.speculation
    paged_cls = runner_cls if runner_cls is not None and issubclass(runner_cls, PagedFastRunner) else PagedFastRunner
    paged = config.kv_cache == "paged" and not config.batch_invariant and (runner_cls in (None, paged_cls))
    strategy = runner_class(loaded.model, batch_invariant=False, fast_path=config.fast_path)[0]
    why_not = None if strategy is FastRunner else paged_generic.unsupported_reason(loaded.model)
    if paged and why_not is None:
        fast_cls = paged_cls if strategy is FastRunner else None
        activation = None
        if config.kv_cache_memory_bytes is None:
            # a prompt step alone: no autotune, no decode graphs (their buffers, scratch block and RoPE table)
            quiet = dataclasses.replace(config, cpu_autotune=False, enforce_eager=True)
            activation = profile_step_memory(
                loaded.device,
                lambda blocks: _paged_runner(loaded, quiet, blocks, fast_cls),
                largest_step_tokens(config, loaded.max_context),
                config.block_size,
            )
        graphs = fast_cls is not None and cuda_graphs.wanted(loaded.device, config.enforce_eager)
        num_blocks = kv_pool_blocks(loaded, config, activation, graphs)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            config.block_size,
            num_blocks * kv_bytes_per_block(loaded.model, config.block_size) / 2**20,
        )
        runner: ModelRunner = _paged_runner(loaded, config, num_blocks, fast_cls)
    elif runner_cls is None:
        if paged:
            log.info("KV cache: slots (the paged cache does not serve %s)", why_not)
        runner = create_runner(
            loaded.model,
            max_slots=config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
            batch_invariant=config.batch_invariant,
            fast_path=config.fast_path,
            autotune=config.cpu_autotune,
            autotune_cache=config.autotune_cache,
        )
    else:
        runner = runner_cls(
            loaded.model,
            max_slots=config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
        )
    codec, grammars = _codec(loaded, max_input_len)
    if spec is not None and isinstance(runner, PersistentBatchRunner):  # without one the engine refuses it
        runner.proposer = _proposer(loaded, config, draft)
    adapters = None
    if config.lora is not None:
        if not isinstance(runner, PersistentBatchRunner):
            raise ValueError(
                "LoRA adapters need the paged KV cache (kv_cache=paged, not batch_invariant, an architecture "
                f"the paged runners serve{'' if why_not is None else ': not ' + why_not})"
            )
        modules = FAST_PATH_MODULES if isinstance(runner, PagedFastRunner) else None
        adapters = AdapterRegistry(loaded.model, config.lora, modules=modules)
        if lora_kernels.available(runner.lora_dtype, loaded.device):
            try:  # compiles (or loads from numba's cache) at load, not on a request
                lora_kernels.warm_up()
            except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the adapters
                log.exception("compiled LoRA products unavailable; using torch's")
                runner.lora_kernels = False
        runner.adapter_lookup = adapters.by_id
    return AsyncEngine(runner, codec, config, grammars, adapters)


def _codec(loaded: LoadedModel, max_input_len: int | None) -> tuple[PromptCodec, GrammarCompiler]:
    """The prompt codec and grammar compiler of `loaded`'s tokenizer."""
    codec = PromptCodec(
        HfTokenizer(loaded.tokenizer),
        eos_token_ids=loaded.eos_token_ids,
        max_context=loaded.max_context,
        max_input_len=max_input_len,
        vocab_size=getattr(loaded.model.config, "vocab_size", None),
    )
    grammars = GrammarCompiler(loaded.tokenizer, vocab_size=codec.vocab_size, eos_token_ids=loaded.eos_token_ids)
    return codec, grammars


def _for_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with what depends on the device resolved: the prefill floor, speculation's batch limit."""
    if config.prefill_floor == "auto":
        config = dataclasses.replace(config, prefill_floor=PREFILL_FLOOR.get(device.type, 256))
    spec = config.speculation
    if spec is not None and spec.disable_by_batch_size is None:
        limit = DISABLE_BY_BATCH_SIZE.get(device.type, DISABLE_BY_BATCH_SIZE["cuda"])
        config = dataclasses.replace(config, speculation=dataclasses.replace(spec, disable_by_batch_size=limit))
    return config


# ---- tensor parallelism (engine/tp_workers.py) --------------------------------------------------------
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
    """What `degree` workers of `model_path` on `device` need (the engine's options among them)."""
    from lmiserve.models.load import resolve_dtype

    config = _for_device(engine_config(settings), device)
    local = degree // settings.nnodes
    if config.kv_cache_memory_bytes is None and device.type == "cpu":  # the node's memory, shared by its ranks
        config = dataclasses.replace(config, kv_cache_memory_bytes=int(available_memory() * CPU_KV_SHARE) // local)
    if config.cpu_autotune:
        log.warning("cpu_autotune: not with tensor parallelism; the workers use the static kernel choice")
        config = dataclasses.replace(config, cpu_autotune=False)
    port = settings.master_port or (29500 if settings.nnodes > 1 else free_port())
    return WorkerSpec(
        model_path=model_path,
        dtype=str(resolve_dtype(settings.dtype, device)).removeprefix("torch."),
        device=device.type,
        load_format=settings.load_format,
        trust_remote_code=settings.trust_remote_code,
        world=degree,
        config=config,
        nnodes=settings.nnodes,
        node_rank=settings.node_rank,
        master_addr=settings.master_addr,
        master_port=port,
        step_timeout=settings.step_timeout,
        log_level=settings.log_level.upper(),
    )


def build_tensor_parallel_engine(loaded: LoadedModel, settings: Settings, degree: int) -> AsyncEngine:
    """The engine of `loaded` (its tokenizer and config; no weights: `models.load.load_model_shell`) over
    `degree` tensor-parallel workers: the model's shape is checked here, before any worker starts."""
    reason = unsplittable_reason(loaded.model.config, degree)
    if reason is not None:
        raise ValueError(reason)
    spec = worker_spec(settings, str(loaded.path), loaded.device, degree)
    executor = TensorParallelExecutor(spec)
    codec, grammars = _codec(loaded, settings.max_input_len)
    return AsyncEngine(executor, codec, spec.config, grammars)


def _paged_runner(
    loaded: LoadedModel, config: EngineConfig, num_blocks: int, fast_cls: type[PagedFastRunner] | None
) -> PagedFastRunner | paged_generic.PagedGenericRunner:
    """The paged runner of `loaded` over a pool of `num_blocks` blocks: the fast one (`fast_cls`) or,
    for another architecture or with fast_path=false, transformers' forward over the blocks."""
    common: dict[str, Any] = {
        "max_slots": config.max_running,
        "max_context": loaded.max_context,
        "eos_token_ids": loaded.eos_token_ids,
        "num_blocks": num_blocks,
        "block_size": config.block_size,
    }
    if fast_cls is not None:
        return fast_cls(
            loaded.model,
            autotune=config.cpu_autotune,
            autotune_cache=config.autotune_cache,
            enforce_eager=config.enforce_eager,
            **common,
        )
    log.info("model runner: generic path over the paged KV cache (transformers' attention)")
    return paged_generic.PagedGenericRunner(loaded.model, **common)


def _proposer(loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None) -> Proposer:
    """Speculative decoding's proposer: prompt lookup, or the draft model over a KV pool of its own
    (as many tokens as the target's pool, for the rows that may draft at once at full context)."""
    spec = config.speculation
    assert spec is not None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if draft is None:
        raise ValueError("speculative decoding with a draft model needs the draft model loaded")
    if draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the model's: drafts must use the same tokens")
    if draft.device != loaded.device:
        raise ValueError(f"the draft model is on {draft.device}, the model on {loaded.device}")
    assert spec.disable_by_batch_size is not None  # resolved by the device (create_engine)
    rows = min(config.max_running, spec.disable_by_batch_size + 1)
    num_blocks = min(kv_pool_blocks(loaded, config), rows * -(-draft.max_context // config.block_size))
    fast = runner_class(draft.model, batch_invariant=False, fast_path=config.fast_path)[0] is FastRunner
    why_not = None if fast else paged_generic.unsupported_reason(draft.model)
    if why_not is not None:
        raise ValueError(f"the draft model cannot run over a paged KV cache: {why_not}")
    log.info(
        "speculative decoding: draft model %s, KV pool of %d blocks (%.1f MiB)",
        spec.draft_name,
        num_blocks,
        num_blocks * kv_bytes_per_block(draft.model, config.block_size) / 2**20,
    )
    quantized = any(isinstance(m, (Int4Linear, Int8Linear)) for m in draft.model.modules())
    if quantized and quantize_output_int8(draft.model):
        log.info("speculative decoding: the quantized draft's output projection is int8 too")
    draft_config = dataclasses.replace(config, cpu_autotune=False)
    return DraftModelProposer(_paged_runner(draft, draft_config, num_blocks, PagedFastRunner if fast else None))
