"""The engine's settings: continuous or dynamic batching, the step budgets, the request queue, the
runner (fast path, batch invariance, CPU autotune), the prefix cache and the paged KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ByteSize, Field, model_validator

from lmiserve.config.settings_types import FieldGroup, KvCacheDtype, KvCacheLayout, RollingBatch

# The one line a start with the slot KV cache stops with.
SLOTS_REFUSED = (
    "kv_cache=slots is no longer served: the paged KV cache serves every model "
    "(batch_invariant=true gives generate()'s output bit for bit)"
)


class EngineFields(FieldGroup):
    """How requests share the engine, and its caches."""

    rolling_batch: RollingBatch = Field(
        "auto",
        description=(
            "`auto` or `lmi` = continuous batching, `disable` = dynamic batching; "
            "LMI engine names (`vllm`, `lmi-dist`, `scheduler`, ...) mean `lmi`."
        ),
        json_schema_extra={
            "allowed": "one of auto, lmi, disable (or an LMI engine name: vllm, lmi-dist, scheduler, trtllm, tnx)"
        },
    )
    max_rolling_batch_size: int = Field(
        32,
        ge=1,
        description=("Most sequences generated together (vLLM's `max_num_seqs`); further requests wait in the queue."),
    )
    max_rolling_batch_prefill_tokens: int = Field(
        2048,
        ge=1,
        description=(
            "Most prompt tokens prefilled in one engine step (the prompt side of the step's budget; "
            "`max_num_batched_tokens` bounds the whole step)."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Most tokens one engine step computes, decoding streams included (vLLM's name and counting): "
            "each decoding stream's token (and its speculative drafts) counts first, prompt chunks fill "
            "the rest, within `max_rolling_batch_prefill_tokens` (the stricter bound wins). At least "
            "`max_rolling_batch_size` (`batch_size` under dynamic batching), or the server refuses to start. "
            "Unset = no bound but the prompt budget (a step is then at most "
            "`max_rolling_batch_prefill_tokens` + `max_rolling_batch_size` tokens)."
        ),
    )
    prefill_tokens_while_decoding: int | None = Field(
        None,
        ge=1,
        description=(
            "While streams decode, a step prefills at most max(this, decoding streams, "
            "`max_rolling_batch_size` - decoding streams) prompt tokens (within "
            "`max_rolling_batch_prefill_tokens`): a step carries no more rows than a full batch or twice its "
            "decoding rows, so admitting prompts never stalls running streams for long, and a batch that is "
            "still filling admits them quickly. Unset = 16 on CPU, 256 on GPU."
        ),
    )
    max_input_len: int | None = Field(
        None,
        ge=1,
        description="Longest accepted prompt in tokens, on every route; unset = the model's context length.",
    )
    max_new_tokens: int = Field(30, ge=1, description="`max_new_tokens` of requests that give none.")
    max_new_tokens_limit: int = Field(
        4096,
        ge=1,
        description=(
            "Largest `max_new_tokens` a request may ask for; a request above it is rejected. "
            "`max_new_tokens` may not be larger."
        ),
    )
    job_queue_size: int = Field(
        1000, ge=1, description="Requests that may wait for a batch slot; beyond it the server answers 503."
    )
    batch_size: int = Field(1, ge=1, description="Dynamic batch size; `> 1` forces `rolling_batch=disable`.")
    max_batch_delay: int = Field(100, ge=0, description="Milliseconds dynamic batching waits for a batch to fill.")
    predict_timeout: float = Field(
        120.0, gt=0, description="Seconds a request may wait for a free batch slot before it fails."
    )
    enable_streaming: bool = Field(
        False, description="Streaming in dynamic-batch mode (LMI's deprecated option; needs `batch_size=1`)."
    )
    batch_invariant: bool = Field(
        False,
        description="Run each sequence's forward pass alone so greedy output equals `model.generate` exactly.",
    )
    fast_path: bool = Field(
        True,
        description=(
            "Run llama/mistral/ministral/qwen2/qwen3/phi3/smollm3/granite/seed_oss/gemma/gemma2/gemma3_text/olmo2/"
            "olmo3/exaone4/starcoder2/glm/glm4 models, the mixtral/qwen2_moe/qwen3_moe/glm4_moe/olmoe mixtures of "
            "experts, and vision-language models' decoders, with lmiserve's own fused forward (one pass per engine "
            "step); `false` forces the generic transformers path. Other models always use the generic path."
        ),
    )
    cpu_autotune: bool = Field(
        True,
        description=(
            "Time the fast path's CPU kernel choices (product shapes, decode attention) at start-up and "
            "keep the fastest, cached per CPU and model in `autotune_cache`; `false` keeps the static defaults."
        ),
    )
    autotune_cache: str | None = Field(
        None,
        description="JSON file of the CPU autotune results; unset = the user cache dir / `lmiserve/autotune.json`.",
    )
    num_threads: int | None = Field(
        None,
        ge=0,
        description=(
            "CPU threads for torch and the compiled kernels (llama.cpp's `-t`). Unset or 0 = `OMP_NUM_THREADS` "
            "if set, else the smallest of the affinity mask, the cgroup CPU quota (`cpu.max`, "
            "`cpu.cfs_quota_us`) and the physical cores, lowered while other processes take those CPUs. "
            "OpenMP threads spin briefly, then sleep (`GOMP_SPINCOUNT=10000`) unless `OMP_WAIT_POLICY` or "
            "`GOMP_SPINCOUNT` is set. See docs/performance/threads.md."
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description=(
            "Keep the KV of computed prompts and answers (in blocks of 16 tokens) and reuse it for later "
            "prompts that start with them (multi-turn chat, a shared system prompt): only the rest is "
            "prefilled. Not with `batch_invariant`. See docs/performance/prefix-cache.md."
        ),
    )
    prefix_cache_size: ByteSize = Field(
        ByteSize(512 * 2**20),
        ge=0,
        description=(
            "Accepted for older configurations and ignored (with a warning at start): the KV pool is the prefix "
            "cache (size it with `kv_cache_memory_bytes`; turn caching off with `enable_prefix_caching=false`)."
        ),
        json_schema_extra={"allowed": "a size >= 0 in bytes, e.g. 536870912, 512MiB or 2GB"},
    )
    kv_cache: KvCacheLayout = Field(
        "paged",
        description=(
            "The KV cache: `paged`, the only one (Engine v2: a pool of blocks sized by `kv_cache_memory_bytes`, "
            "admission by free blocks, preemption when the pool runs out, prompt chunks of several requests in "
            "one step, the prefix cache as shared blocks, sliding-window attention). `slots`, the slot KV cache, "
            "is no longer served and stops the start; `batch_invariant=true` gives `generate()`'s output bit for "
            "bit. See docs/engine.md."
        ),
        json_schema_extra={"allowed": "paged"},
    )
    kv_cache_memory_bytes: ByteSize | None = Field(
        None,
        ge=1,
        description=(
            "Memory of the paged KV cache's pool, per model (per worker with tensor parallelism; vLLM's name), "
            "in bytes or with a unit (`4GiB`); unset = on CPU 25 % of the memory available at start-up, on CUDA "
            "`gpu_memory_utilization` of the GPU less what the model took and the activations of the largest "
            "step and of the sampler over `max_rolling_batch_size` rows, profiled at start; never more than "
            "`max_rolling_batch_size` "
            "sequences at full context need. With a draft model (`speculative_config`) it holds the draft's "
            "pool too: the draft gets the blocks of the rows that may draft at once, the model the rest. A "
            "request that needs more than the whole pool answers 4xx."
        ),
        json_schema_extra={"allowed": "a size >= 1 in bytes, e.g. 4294967296 or 4GiB (or empty for unset)"},
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description=(
            "Share of the GPU's memory lmiserve may take (LMI's and vLLM's name); sizes the paged KV pool. It is "
            "each process's share, as vLLM's: an LLM's engine process (the default on a GPU) takes it, and never "
            "more than the GPU has free at its start, so a second LLM's engine process or another program keeps "
            "its memory (two LLMs on one GPU, each in its engine process: 0.45 each; or the second gets what the "
            "first left)."
        ),
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens a block of the paged KV cache holds (vLLM's name).")
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description=(
            "What the paged KV cache stores (vLLM's name): `auto` = the model's dtype; `bfloat16` (= `bf16`) = "
            "two bytes an element, so an fp32 model (a CPU's default) holds twice the blocks, its attention still "
            "summing in fp32 (the same as `auto` for a bf16 model; refused for an fp16 one); `fp8` (= `fp8_e4m3`) "
            "or `fp8_e5m2` = one byte an element, so the same memory holds twice the blocks of bf16 (four times "
            "fp32). fp8 keys and values are divided by a per-layer scale and clamped when written, cast back and "
            "multiplied when read; the scales are the checkpoint's `k_scale`/`v_scale` (or `kv_scale`) where it "
            "has them, else 1.0. Each costs a little accuracy (docs/engine.md); on CPU the compiled attention reads "
            "either. With tensor parallelism each rank's pool stores its KV heads so."
        ),
        json_schema_extra={"allowed": "one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"},
    )
    async_scheduling: bool | None = Field(
        None,
        description=(
            "Overlap scheduling (vLLM's `--async-scheduling`): the next step is planned and queued while one runs, "
            "and a step's tokens are detokenized, checked for stops and streamed while the next one runs. Unset: "
            "on for a model on a GPU, off on the CPU (where the model and the host share the cores: measured in "
            "benchmarks/README.md). Output is the same either way; a request that stops computes one step more. "
            "Steps with speculative decoding are planned after the step before them; a grammar's or thinking "
            "budget's rows are sampled once the step before is applied, the rest of their step planned and run "
            "ahead. With tensor parallelism a step planned ahead is sent to the ranks before the step before it is "
            "answered, and launched behind it on the GPUs (docs/tensor-parallel.md). See docs/engine.md."
        ),
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description=(
            "Tokens of a sequence the server streams together (SGLang's and vLLM's `--stream-interval`): 1 sends "
            "each token when its step ends; N > 1 holds a sequence's tokens and sends them N at a time, in one "
            "write (its first token and its end at once), so at high concurrency the server spends less CPU a "
            "token (fewer wake-ups and writes) at the cost of smoothness: the client reads N tokens at once. "
            "Protocols are unchanged (one event or line a token). See docs/engine.md."
        ),
    )
    engine_process: bool | None = Field(
        None,
        description=(
            "Run the LLM and its engine core (scheduling, detokenizing, the model's steps) in a process of their "
            "own, as vLLM's engine-core process: the server's event loop (HTTP, protocols, streaming) and the "
            "engine then no longer share one Python GIL, which limits many concurrent streams on a fast GPU. "
            "Unset: on for an LLM on a GPU (on an H200, 1.6x the tokens/s of one process at 32 and at 128 "
            "streams: benchmarks/README.md), off on the CPU (where the two processes would share the same "
            "cores). Output is the same; each step's events cross a pipe. With tensor parallelism the ranks are "
            "the engine process's children; with LoRA the adapter registry is the engine process's. See "
            "docs/engine.md."
        ),
    )
    enforce_eager: bool = Field(
        False,
        description=(
            "On CUDA, run every step eagerly: no decode steps replayed as CUDA graphs (LMI's and vLLM's name). "
            "Graphs apply to the fast path over the paged KV cache on one GPU; see docs/engine.md."
        ),
    )
    cuda_graph_prompt_tokens: int = Field(
        0,
        ge=0,
        le=512,
        description=(
            "On CUDA, a step whose prompt chunks hold at most this many tokens (together) replays the decode "
            "CUDA graphs too, each prompt token one more row (its attention over its own sequence up to its "
            "position), instead of running eagerly: a request joining a running batch no longer turns the "
            "batch's step eager, several times slower (more graph sizes are captured at start, up to "
            "`max_rolling_batch_size` plus this). 0 = off: a step with prompt tokens runs eagerly. Not with "
            "LoRA adapters in the step. Not yet measured on a GPU; see docs/engine.md."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_slots(cls, data: Any) -> Any:
        """`kv_cache=slots` (the slot KV cache, removed) stops the start with one line, before any other check."""
        if isinstance(data, Mapping) and str(data.get("kv_cache", "")).strip().lower() == "slots":
            sources = data.get("sources")
            source = sources.get("kv_cache") if isinstance(sources, Mapping) else None
            raise ValueError(SLOTS_REFUSED + (f" (from {source})" if source else ""))
        return data

    @property
    def dynamic_batching(self) -> bool:
        """True when requests are batched statically (LMI's non-rolling mode), not continuously."""
        return self.rolling_batch == "disable" or self.batch_size > 1
