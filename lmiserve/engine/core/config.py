"""The engine's options as plain values (the settings are read above the engine: models/compose.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmiserve.engine.lora.registry import LoraLimits
from lmiserve.engine.speculative.proposers import SpeculationSettings


@dataclass
class EngineConfig:
    max_running: int = 32
    max_prefill_tokens: int = 2048
    # tokens a step computes, decode rows included (vLLM's max_num_batched_tokens; None = no such bound)
    max_step_tokens: int | None = None
    job_queue_size: int = 1000
    predict_timeout: float | None = 120.0
    static_batching: bool = False
    batch_size: int = 1
    max_batch_delay: float = 0.1
    batch_invariant: bool = False
    fast_path: bool = True  # own Llama-family forward when supported; False forces the generic path
    cpu_autotune: bool = False  # time the fast path's CPU kernel choices at start-up (engine/model/autotune.py)
    autotune_cache: str | None = None  # its JSON cache; None = <user cache dir>/lmiserve/autotune.json
    # prompt tokens a step that also decodes may take: max(this, decoding rows, max_running - decoding rows);
    # None = no extra bound; "auto" = by device (engine/factory.py)
    prefill_floor: int | Literal["auto"] | None = "auto"
    # prefix caching: a prompt starts from the pool's blocks of an earlier one with the same head (the KV
    # pool is the cache; never with batch_invariant)
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # the paged pool's budget; None = by device (engine/factory.py)
    block_size: int = 16  # tokens a block of the paged pool holds
    # what the paged pool stores: "auto" (the model's dtype), "fp8" = "fp8_e4m3", "fp8_e5m2" (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of the GPU the paged pool's default budget fills
    # overlap scheduling: the next step planned and queued while one runs, its results applied meanwhile
    # (engine/core/engine_core.py); None = by device (engine/factory.py)
    async_scheduling: bool | None = None
    # before serving, run each prompt and decode shape once (engine/core/warmup.py); None = by device (on CUDA)
    warmup: bool | None = None
    enforce_eager: bool = False  # on CUDA: no decode steps replayed as CUDA graphs (engine/attention/cuda_graphs.py)
    # on CUDA: a step's prompt chunks of up to this many tokens (together) replay the decode graphs too, each
    # token a row (engine/attention/cuda_graphs.py); 0: a step with a prompt chunk runs eagerly
    graph_prompt_tokens: int = 0
    stream_interval: int = 1  # a sequence's tokens delivered N at a time, its first at once (handles.py)
    speculation: SpeculationSettings | None = None  # speculative decoding (engine/speculative/proposers.py)
    lora: LoraLimits | None = None  # LoRA adapters (engine/lora/registry.py; None: none served)
