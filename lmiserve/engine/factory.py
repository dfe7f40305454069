"""Build the engine of a loaded model from an `EngineConfig`: the runner (fast, generic or batch-invariant,
all over the paged KV pool), the pool sized for the device, the prompt codec, speculative decoding's proposer and the
LoRA adapters. Plain values only: the settings are read above the engine (models/compose.py)."""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.attention import cuda_graphs, kv_quant
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import AttentionShape
from lmiserve.engine.codecs import image_codec, prompt_codec
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.core.step import BatchRunner, NewRequest, ScheduledTokens, StepBatch
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.lora import kernels as lora_kernels
from lmiserve.engine.lora.adapters import LoraAdapter
from lmiserve.engine.lora.manager import LoraManager
from lmiserve.engine.lora.registry import AdapterRegistry
from lmiserve.engine.model.llama_layout import SUPPORTED_TYPES
from lmiserve.engine.model.quantize import Int4Linear, Int8Linear, quantize_output_int8
from lmiserve.engine.pool_plan import (
    CPU_KV_SHARE,
    DraftNeeds,
    MemoryReader,
    available_memory,
    block_bytes,
    largest_step_tokens,
    plan_pools,
    profiled_sampling,
    report_draft_pool,
)
from lmiserve.engine.runner import fast_path_modules, fast_reason, generic
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
from lmiserve.engine.runner.sampling import sample_profile
from lmiserve.engine.runner.vision import PagedVisionRunner, is_vision_model
from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner, fast_vision_reason
from lmiserve.engine.speculative.proposers import DraftModelProposer, NgramProposer
from lmiserve.engine.text.images import PromptIds, probe_prompt

log = logging.getLogger(__name__)
FastRunnerClass = type[PagedFastRunner] | type[PagedFastVisionRunner]  # lmiserve's forward: a text model's, a VLM's


def run_profile_step(
    runner_of: Callable[[int], BatchRunner],
    tokens: int,
    block_size: int,
    prompt: PromptIds | None = None,
    sampler: tuple[int, int] | None = None,
) -> int:
    """Run one step of a `tokens`-token prompt on a runner made by `runner_of(blocks)` over just enough
    blocks, as the largest step the scheduler plans would (every layer's activations at their widest);
    the bytes of that runner's pool. The runner is dropped after. `prompt`: a vision-language model's
    prompt with an image instead (`text.images.probe_prompt`): its image encoder runs at admission.
    `sampler`: ``(rows, vocab)``, then the sampler's largest step there (`sampling.sample_profile`)."""
    ids = list(prompt) if prompt is not None else [0] * tokens
    blocks = -(-len(ids) // block_size)
    runner = runner_of(blocks)
    params = SamplingParams(max_new_tokens=1)
    images = prompt.images if prompt is not None else None
    batch = StepBatch(
        rows=[ScheduledTokens(0, 0, ids, list(range(blocks)), sample=True)],
        new=[NewRequest(0, ids, params, seed=0, images=images)],
    )
    output = runner.execute_batch(batch)
    if output.errors:
        raise RuntimeError(f"the profiling step failed: {next(iter(output.errors.values()))}")
    if sampler is not None:  # its failure costs the sampler's share of the reserve, not the step's figure
        device = getattr(runner, "device", torch.device("cpu"))  # (every paged runner's model's)
        try:
            failed = [r for r in sample_profile(*sampler, device) if isinstance(r, Exception)]
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at a large batch limit and vocabulary
            failed = [exc]
        if failed:
            log.warning(
                "profiling the sampler over %d rows failed (%s); its memory may not be reserved", sampler[0], failed[0]
            )
    runner.execute_batch(StepBatch(finished=[0]))
    return int(getattr(runner, "kv_bytes", 0))


def profile_step_memory(
    device: torch.device,
    runner_of: Callable[[int], BatchRunner],
    tokens: int,
    block_size: int,
    image_prompt: PromptIds | None = None,
    sampler: tuple[int, int] | None = None,
) -> int | None:
    """On CUDA, the peak memory the largest step needs beyond what is allocated before it and beyond its
    pool (`run_profile_step`): what the KV pool must leave free (vLLM sizes its pool after such a run).
    `image_prompt`: a VLM's step with an image is profiled too (its encoder's activations, its features),
    the larger peak kept; `sampler` (``(rows, vocab)``): the sampler's largest step too, after the first
    step. None on other devices, or when the profiling step fails (logged; the fixed reserve is used)."""
    if device.type != "cuda":
        return None
    peak = 0
    for prompt in (None, image_prompt) if image_prompt is not None else (None,):
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            pool = run_profile_step(runner_of, tokens, block_size, prompt, sampler if prompt is None else None)
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - before - pool)
        except Exception:  # noqa: BLE001 - a failed profile costs the pool's precision, not the start
            log.exception("profiling the largest step failed; the KV pool leaves the fixed activation reserve")
            return None
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    what = f"{tokens} tokens" + (f", and {len(image_prompt)} with an image" if image_prompt is not None else "")
    log.info("profiled the largest step (%s): %.2f GiB of activations", what, peak / 2**30)
    return max(0, int(peak))


# Rows from which speculative decoding stops drafting, by device, unless disable_by_batch_size says:
# on CPU a step of a few rows still costs about the weights it reads (benchmarks/README.md).
# (`speculative_config`'s help in config/speculative.py says the same: tests/unit/test_speculative.py)
DISABLE_BY_BATCH_SIZE = {"cpu": 4, "cuda": 32}

# Prompt tokens a step that also decodes may take at least (it takes max(floor, decoding rows)).
# CPU: a step's cost is ~ weight read + tokens x per-token compute; 16 extra tokens at most double
# a 1-row decode step and add ~1/3 to a 32-row one (benchmarks/README.md, "prefill budget").
# GPU: a step costs about the same up to hundreds of tokens (not measured here).
PREFILL_FLOOR = {"cpu": 16, "cuda": 256}


def create_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    max_input_len: int | None = None,
    draft: LoadedModel | None = None,
    memory: MemoryReader | None = None,
) -> AsyncEngine:
    """The engine for `loaded`; the runner strategy follows `config`;
    `draft`: the draft model of `config.speculation` (method draft_model), its KV pool planned with the
    model's (engine/pool_plan.py); `memory`: reads the device's free bytes in place of the device."""
    config = _for_device(config, loaded.device)
    spec = config.speculation
    vision = is_vision_model(loaded.model)
    reason = fast_vision_reason if vision else fast_reason
    why_not = reason(loaded.model, fast_path=config.fast_path, lora=config.lora is not None)
    if vision and spec is not None and spec.method != "ngram":
        raise ValueError(
            "speculative decoding with a draft model is not served with a vision-language model (prompt lookup, "
            "method ngram, is)"
        )
    fast_cls: FastRunnerClass | None = None
    if why_not is None and not config.batch_invariant:
        fast_cls = PagedFastVisionRunner if vision else PagedFastRunner
    if fast_cls is None:
        refusal = generic.unsupported_reason(loaded.model)
        if refusal is not None:
            mine = "" if why_not is None else f"; lmiserve's own forward does not either: {why_not}"
            raise ValueError(f"this model cannot be served: transformers' forward over the KV blocks: {refusal}{mine}")
        if not config.batch_invariant and loaded.device.type == "cuda" and not vision and config.fast_path:
            log.warning(  # what a GPU user most needs to know of it: no decode graphs (docs/models.md)
                "model runner: generic path over the paged KV cache (transformers' forward; %s): its steps run "
                "eagerly, without CUDA graphs; lmiserve's own forward runs %s",
                why_not,
                ", ".join(SUPPORTED_TYPES),
            )
        elif not config.batch_invariant:
            log.info("model runner: generic path over the paged KV cache (transformers' forward; %s)", why_not)
    drafting = spec is not None and spec.method != "ngram"
    draft_cls = draft_runner_class(loaded, config, draft) if drafting else None
    activation = draft_activation = None
    if config.kv_cache_memory_bytes is None:
        # a prompt step alone: no autotune, no decode graphs (their buffers, scratch block and RoPE table)
        quiet = dataclasses.replace(config, cpu_autotune=False, enforce_eager=True)
        images = image_codec(loaded) if loaded.device.type == "cuda" else None
        activation = profile_step_memory(
            loaded.device,
            lambda blocks: _paged_runner(loaded, quiet, blocks, fast_cls),
            largest_step_tokens(config, loaded.max_context),
            config.block_size,
            probe_prompt(images) if images is not None else None,
            profiled_sampling(loaded, config),
        )
        if drafting and draft is not None:  # the draft's largest step, profiled too: both are reserved
            drafter = draft
            draft_activation = profile_step_memory(
                drafter.device,
                lambda blocks: _paged_runner(drafter, quiet, blocks, draft_cls),
                largest_step_tokens(config, drafter.max_context),
                config.block_size,
            )
    graphs = fast_cls is not None and cuda_graphs.wanted(loaded.device, config.enforce_eager)
    needs = None
    if drafting and draft is not None:
        draft_graphs = draft_cls is not None and cuda_graphs.wanted(draft.device, config.enforce_eager)
        needs = DraftNeeds(draft, draft_rows(config), draft_activation, draft_graphs)
    plan = plan_pools(loaded, config, activation, graphs, needs, memory)
    log.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
        plan.blocks,
        config.block_size,
        plan.blocks * block_bytes(loaded.model, config) / 2**20,
        kv_quant.storage_dtype(config.kv_cache_dtype, loaded.model.dtype),
    )
    runner = _paged_runner(loaded, config, plan.blocks, fast_cls)
    if config.graph_prompt_tokens and cuda_graphs.of_runner(runner) is None:
        log.warning(
            "cuda_graph_prompt_tokens=%d has no effect here: no CUDA graphs (they need CUDA, the fast path with "
            "the Triton attention, one GPU and no enforce_eager)",
            config.graph_prompt_tokens,
        )
    codec, grammars = prompt_codec(loaded, max_input_len)
    if spec is not None and needs is None:
        runner.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec is not None and needs is not None:
        report_draft_pool(plan, needs, config, loaded.max_context, spec.num_speculative_tokens)
        runner.proposer = draft_proposer(needs.loaded, config, plan.draft_blocks, draft_cls)
    adapters = None
    if config.lora is not None:
        fast = isinstance(runner, (PagedFastRunner, PagedFastVisionRunner))
        modules = fast_path_modules(loaded.model) if fast else None
        manager = attach_lora(runner, config.lora.max_lora_rank, modules)
        decode_graphs = runner.graphs if isinstance(runner, (PagedFastRunner, PagedFastVisionRunner)) else None
        if decode_graphs is not None:  # decode steps with adapters replay the graphs too
            decode_graphs.carry_lora(config.lora.max_loras, config.lora.max_lora_rank)
        # the registry reads adapters through the runner's manager: one read, one copy of the weights
        adapters = AdapterRegistry(loaded.model, config.lora, modules=modules, loader=manager.load)
    engine = AsyncEngine(runner, codec, config, grammars, adapters, decode_rows(runner, config.max_running))
    log.info(
        "engine: overlap scheduling %s, warm-up before serving %s (async_scheduling; docs/engine.md)",
        "on" if config.async_scheduling else "off",
        "on" if config.warmup else "off",
    )
    return engine


def decode_rows(runner: PersistentBatchRunner, max_running: int) -> tuple[int, ...]:
    """The decode row counts a warm-up runs (engine/core/warmup.py): each CUDA graph's size (a step of
    up to `max_running` rows), else one row, a multiple of 16 and the most rows (the Triton kernels'
    specializations)."""
    graphs = cuda_graphs.of_runner(runner)
    sizes = graphs.sizes if graphs is not None else (1, 16, max_running)
    return tuple(sorted({min(size, max_running) for size in sizes}))


def attach_lora(
    runner: PersistentBatchRunner,
    max_rank: int,
    modules: Sequence[str] | None,
    shard: Callable[[LoraAdapter], LoraAdapter] | None = None,
) -> LoraManager:
    """Serve LoRA adapters on `runner`: a `LoraManager` beside it (adapters of rank up to `max_rank` on
    the linears `modules` names, None: any; `shard`: what a tensor-parallel rank keeps of one), and the
    compiled LoRA products compiled now where they apply."""
    manager = runner.lora = LoraManager(runner.model, max_rank, modules, shard)
    if lora_kernels.available(runner.lora_dtype, runner.device):
        try:  # compiles (or loads from numba's cache) at load, not on a request
            lora_kernels.warm_up()
        except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the adapters
            log.exception("compiled LoRA products unavailable; using torch's")
            runner.lora_kernels = False
    return manager


def _for_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with what depends on the device resolved: the prefill floor, speculation's batch limit,
    overlap scheduling (on a GPU, where the host waits for the device; off on the CPU, where the model and
    the host share the cores: benchmarks/README.md "Overlap scheduling")."""
    if config.prefill_floor == "auto":
        config = dataclasses.replace(config, prefill_floor=PREFILL_FLOOR.get(device.type, 256))
    if config.async_scheduling is None:
        config = dataclasses.replace(config, async_scheduling=device.type == "cuda")
    if config.warmup is None:  # on a GPU a new shape compiles kernels and captures a graph (engine/core/warmup.py)
        config = dataclasses.replace(config, warmup=device.type == "cuda")
    spec = config.speculation
    if spec is not None and spec.disable_by_batch_size is None:
        limit = DISABLE_BY_BATCH_SIZE.get(device.type, DISABLE_BY_BATCH_SIZE["cuda"])
        config = dataclasses.replace(config, speculation=dataclasses.replace(spec, disable_by_batch_size=limit))
    return config


def worker_config(config: EngineConfig, device: torch.device, local_ranks: int) -> EngineConfig:
    """`config` as each of a node's `local_ranks` tensor-parallel workers on `device` runs it: resolved for
    the device, the node's memory shared by its ranks on a CPU (unless `kv_cache_memory_bytes` says), no
    CPU autotune (the workers use the static kernel choice)."""
    config = _for_device(config, device)
    if config.kv_cache_memory_bytes is None and device.type == "cpu":  # the node's memory, shared by its ranks
        share = int(available_memory() * CPU_KV_SHARE) // local_ranks
        config = dataclasses.replace(config, kv_cache_memory_bytes=share)
    if config.cpu_autotune:
        log.warning("cpu_autotune: not with tensor parallelism; the workers use the static kernel choice")
        config = dataclasses.replace(config, cpu_autotune=False)
    return config


def _paged_runner(
    loaded: LoadedModel, config: EngineConfig, num_blocks: int, fast_cls: FastRunnerClass | None
) -> PagedFastRunner | generic.PagedGenericRunner:
    """The runner of `loaded` over a pool of `num_blocks` blocks: the fast one (`fast_cls`) or, for another
    architecture, with fast_path=false or batch_invariant, transformers' forward over the blocks. The pool
    stores `kv_cache_dtype` (an fp8 one with the checkpoint's KV scales, engine/attention/kv_quant.py)."""
    kv_format = kv_format_of(loaded, config)
    if fast_cls is not None:
        return fast_cls(
            loaded.model,
            max_slots=config.max_running,
            max_context=loaded.max_context,
            eos_token_ids=loaded.eos_token_ids,
            num_blocks=num_blocks,
            block_size=config.block_size,
            autotune=config.cpu_autotune,
            autotune_cache=config.autotune_cache,
            enforce_eager=config.enforce_eager,
            kv_format=kv_format,
            graph_prompt_tokens=config.graph_prompt_tokens,
        )
    runner_cls = PagedVisionRunner if is_vision_model(loaded.model) else generic.PagedGenericRunner
    return runner_cls(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        num_blocks=num_blocks,
        block_size=config.block_size,
        alone=config.batch_invariant,
        kv_format=kv_format,
    )


def kv_format_of(loaded: LoadedModel, config: EngineConfig) -> KvFormat:
    """What `loaded`'s KV pool stores (`kv_cache_dtype`; an fp8 one with the checkpoint's per-layer KV scales, the
    same on every tensor-parallel rank)."""
    return KvFormat.of(config.kv_cache_dtype, loaded.path, AttentionShape.of(loaded.model.config).layers)


def draft_proposer(
    draft: LoadedModel, config: EngineConfig, blocks: int, draft_cls: type[PagedFastRunner] | None
) -> DraftModelProposer:
    """The proposer of speculative decoding's `draft` model: its runner (`draft_cls`, `draft_runner_class`) over a
    pool of `blocks` blocks of its own."""
    return DraftModelProposer(_paged_runner(draft, dataclasses.replace(config, cpu_autotune=False), blocks, draft_cls))


def draft_rows(config: EngineConfig) -> int:
    """The rows that may draft at once: one past the batch size that turns drafting off, at most `max_running`."""
    spec = config.speculation
    assert spec is not None and spec.disable_by_batch_size is not None  # resolved by the device (create_engine)
    return min(config.max_running, spec.disable_by_batch_size + 1)


def draft_runner_class(
    loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None
) -> type[PagedFastRunner] | None:
    """The fast runner class when the draft model runs lmiserve's forward (None: transformers' over the
    blocks); a draft that cannot be served stops the start. Its int8 output projection when quantized."""
    spec = config.speculation
    assert spec is not None
    if draft is None:
        raise ValueError("speculative decoding with a draft model needs the draft model loaded")
    if draft.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the model's: drafts must use the same tokens")
    if draft.device != loaded.device:
        raise ValueError(f"the draft model is on {draft.device}, the model on {loaded.device}")
    fast = fast_reason(draft.model, fast_path=config.fast_path) is None
    why_not = None if fast else generic.unsupported_reason(draft.model)
    if why_not is not None:
        raise ValueError(f"the draft model cannot run over a paged KV cache: {why_not}")
    log.info("speculative decoding: draft model %s", spec.draft_name)
    quantized = any(isinstance(m, (Int4Linear, Int8Linear)) for m in draft.model.modules())
    if quantized and quantize_output_int8(draft.model):
        log.info("speculative decoding: the quantized draft's output projection is int8 too")
    return PagedFastRunner if fast else None
