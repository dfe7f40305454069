"""Build the engine for a loaded model from the server settings."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import torch

from lmiserve.engine.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.grammar_compiler import GrammarCompiler
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.runners import FastRunner, ModelRunner, create_runner, paged_generic, runner_class
from lmiserve.engine.runners.paged import PagedFastRunner, kv_bytes_per_block
from lmiserve.engine.tokenizer import HfTokenizer
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


def kv_pool_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    """Blocks of the paged KV pool: the budget (`kv_cache_memory_bytes`, else by device) over a block's
    bytes, never more than `max_running` sequences at full context need, at least one."""
    per_block = kv_bytes_per_block(loaded.model, config.block_size)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        device = loaded.device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            budget = int(config.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device)
            budget -= GPU_ACTIVATION_RESERVE
        else:
            budget = int(available_memory() * CPU_KV_SHARE)
    full_batch = config.max_running * -(-loaded.max_context // config.block_size)
    return max(1, min(budget // per_block, full_batch))


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
    )


def build_engine(loaded: LoadedModel, settings: Settings) -> AsyncEngine:
    return create_engine(loaded, engine_config(settings), max_input_len=settings.max_input_len)


def create_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    max_input_len: int | None = None,
    runner_cls: type[ModelRunner] | None = None,
) -> AsyncEngine:
    """The engine for `loaded`; the runner strategy follows `config` unless `runner_cls` is given."""
    if config.prefill_floor == "auto":
        config = dataclasses.replace(config, prefill_floor=PREFILL_FLOOR.get(loaded.device.type, 256))
    paged_cls = runner_cls if runner_cls is not None and issubclass(runner_cls, PagedFastRunner) else PagedFastRunner
    paged = config.kv_cache == "paged" and not config.batch_invariant and (runner_cls in (None, paged_cls))
    strategy = runner_class(loaded.model, batch_invariant=False, fast_path=config.fast_path)[0]
    why_not = None if strategy is FastRunner else paged_generic.unsupported_reason(loaded.model)
    if paged and why_not is None:
        num_blocks = kv_pool_blocks(loaded, config)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            config.block_size,
            num_blocks * kv_bytes_per_block(loaded.model, config.block_size) / 2**20,
        )
        runner: ModelRunner
        if strategy is FastRunner:
            runner = paged_cls(
                loaded.model,
                max_slots=config.max_running,
                max_context=loaded.max_context,
                eos_token_ids=loaded.eos_token_ids,
                num_blocks=num_blocks,
                block_size=config.block_size,
                autotune=config.cpu_autotune,
                autotune_cache=config.autotune_cache,
            )
        else:  # another architecture, or fast_path=false: transformers' forward over the blocks
            log.info("model runner: generic path over the paged KV cache (transformers' attention)")
            runner = paged_generic.PagedGenericRunner(
                loaded.model,
                max_slots=config.max_running,
                max_context=loaded.max_context,
                eos_token_ids=loaded.eos_token_ids,
                num_blocks=num_blocks,
                block_size=config.block_size,
            )
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
    codec = PromptCodec(
        HfTokenizer(loaded.tokenizer),
        eos_token_ids=loaded.eos_token_ids,
        max_context=loaded.max_context,
        max_input_len=max_input_len,
        vocab_size=getattr(loaded.model.config, "vocab_size", None),
    )
    grammars = GrammarCompiler(loaded.tokenizer, vocab_size=codec.vocab_size, eos_token_ids=loaded.eos_token_ids)
    return AsyncEngine(runner, codec, config, grammars)
