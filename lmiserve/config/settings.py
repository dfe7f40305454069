"""Typed server settings: every key with its default, meaning and validation.

Build a ``Settings`` from string options (properties file, environment, ``-o key=value``) with
``Settings.from_options``: it coerces strings, keeps unknown keys in ``extra`` (with one warning line
naming them all) and turns every validation failure into a ``ConfigError`` naming the key, the value
and what is allowed.
``lmiserve.config.sources.load_settings`` merges the sources and calls it.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lmiserve.config.errors import ConfigError
from lmiserve.config.lora import parse_lora_adapters, parse_lora_modules
from lmiserve.config.messages import describe_errors
from lmiserve.config.properties import strip_option_prefix
from lmiserve.config.speculative import SpeculativeConfig, parse_speculative_config

logger = logging.getLogger(__name__)

# Other spellings of the same key: LMI's, and vLLM's engine arguments (LMI passes option.<vLLM argument> on).
KEY_ALIASES: dict[str, str] = {
    "max_dynamic_batch_size": "batch_size",  # LMI
    "max_num_seqs": "max_rolling_batch_size",  # vLLM
    "max_model_len": "max_total_tokens",  # vLLM: prompt + output tokens
    "tensor_parallel_size": "tensor_parallel_degree",  # vLLM
}

# LMI (DJL Serving) keys that lmiserve accepts in serving.properties and OPTION_* variables and ignores:
# they choose another engine's features (parallelism, quantization, LoRA, Python handlers). They are kept
# in ``extra`` and named in the start-up warning; on the command line (-o) they are an error, like any
# unknown key.
LMI_IGNORED_KEYS = frozenset(
    {
        "engine",
        "entryPoint",
        "pipeline_parallel_degree",
        "quantize",
        "mpi_mode",
        "task",
        "model_loading_timeout",
        "parallel_loading",
        "minWorkers",
        "maxWorkers",
    }
)

# LMI engine names for rolling_batch; lmiserve has one continuous-batching engine ("lmi").
LMI_ENGINE_NAMES = frozenset({"vllm", "lmi-dist", "lmi_dist", "scheduler", "trtllm", "tnx", "deepspeed"})

LMI_SPECULATIVE_LENGTH = 5  # LMI's default speculative_length

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_WORD_ALIASES: dict[str | None, dict[str, str]] = {
    "dtype": {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"},
    "log_level": {"warn": "warning"},
}
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
_META_FIELDS = frozenset({"extra", "sources"})

Dtype = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]
LoadFormat = Literal["auto", "safetensors", "pt", "dummy"]
OtlpProtocol = Literal["grpc", "http/protobuf"]
KvCacheLayout = Literal["paged", "slots"]
ModelKind = Literal["auto", "llm", "embedding", "classifier", "regression", "torchscript"]
RollingBatch = Literal["auto", "lmi", "disable"]
# `reasoning_parser` presets (vLLM's `--reasoning-parser` names): start and end markers of the reasoning
# block ("" start: the output always starts in it); the other spellings a family writes and the text a
# thinking budget forces to close the block: lmiserve.protocols.textgen.reasoning
REASONING_PRESETS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "deepseek_v3": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "glm47": ("<think>", "</think>"),
    "ernie45": ("<think>", "</think>"),
    "hunyuan_a13b": ("<think>", "</think>"),
    "minimax_m2": ("<think>", "</think>"),
    "mimo": ("<think>", "</think>"),
    "holo2": ("<think>", "</think>"),
    "olmo3": ("<think>", "</think>"),
    "step3": ("", "</think>"),
    "step3p5": ("<think>", "</think>"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "granite": ("Here is my thought process:", "Here is my response:"),
    "openai_gptoss": ("<|channel|>analysis<|message|>", "<|end|>"),
}
ReasoningParser = Literal[
    "deepseek_r1",
    "deepseek_v3",
    "qwen3",
    "glm45",
    "glm47",
    "ernie45",
    "hunyuan_a13b",
    "minimax_m2",
    "mimo",
    "holo2",
    "olmo3",
    "step3",
    "step3p5",
    "seed_oss",
    "mistral",
    "granite",
    "openai_gptoss",
]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's `reasoning_effort` values
_UNBOUNDED = frozenset({"none", "unlimited", "unbounded", "-1"})


def parse_effort_budgets(value: str) -> dict[str, int | None]:
    """`reasoning_effort_budgets` ("low:1024,medium:none,...") as {effort: thinking tokens, None: no bound};
    `none` is always 0. ValueError for a malformed list."""
    budgets: dict[str, int | None] = {"none": 0}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        effort, sep, tokens = (s.strip().lower() for s in item.partition(":"))
        if not sep or effort not in REASONING_EFFORTS[1:]:
            raise ValueError(f"`{item}`: each item is effort:tokens, effort one of {', '.join(REASONING_EFFORTS[1:])}")
        if tokens in _UNBOUNDED:
            budgets[effort] = None
        elif tokens.isdigit():
            budgets[effort] = int(tokens)
        else:
            raise ValueError(f"`{item}`: tokens is a whole number >= 0 or `none` (no bound)")
    return budgets


# `tool_call_parser` values (vLLM's `--tool-call-parser` names; lmiserve.protocols.textgen.tools.parsers)
ToolCallParser = Literal[
    "auto",
    "json",
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "llama4_pythonic",
    "pythonic",
    "mistral",
    "deepseek_v3",
    "granite",
    "openai",
]
OutputFormatter = Literal["json", "jsonlines", "sse", "tgi_compat"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]


def canonical_key(key: str) -> str:
    """Drop ``option.`` and resolve aliases: ``option.max_dynamic_batch_size`` -> ``batch_size``."""
    key = strip_option_prefix(key.strip())
    return KEY_ALIASES.get(key, key)


def close_key(key: str) -> str | None:
    """The valid key or alias ``key`` was probably meant to be (``max_rolling_batch_sise`` ->
    ``max_rolling_batch_size``, ``max-new-tokens`` -> ``max_new_tokens``), or None."""
    valid = [*Settings.option_keys(), *KEY_ALIASES]
    word = key.strip().lower().replace("-", "_")
    if word in valid:
        return word
    matches = difflib.get_close_matches(word, valid, n=1, cutoff=0.75)
    return matches[0] if matches else None


def unknown_key_note(key: str) -> str:
    """Why ``key`` is not used: an LMI key lmiserve ignores, or a did-you-mean, or nothing."""
    if key in LMI_IGNORED_KEYS:
        return "an LMI option lmiserve does not use"
    suggestion = close_key(key)
    return f"did you mean {suggestion!r}?" if suggestion else ""


def unknown_option_error(keys: Iterable[str], source: str = "") -> str:
    """The error of unknown command-line keys: ``unknown option 'x' (did you mean 'y'?)``, one per key."""
    parts = []
    for key in keys:
        note = unknown_key_note(key)
        if key in LMI_IGNORED_KEYS:
            note += "; it is ignored in serving.properties and OPTION_* variables, not accepted here"
        elif not note:
            note = "`lmiserve options` lists every option"
        parts.append(f"unknown option {key!r}{source} ({note})")
    return "; ".join(parts)


class Settings(BaseModel):
    """Effective server configuration. Build it with ``from_options`` or ``load_settings``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # The descriptions are the documentation: `lmiserve options`, `lmiserve serve --help` and
    # docs/configuration.md (scripts/gen_config_reference.py) print them. Write `code` in backticks.
    # --- model ---
    model_id: str | None = Field(
        None,
        description=(
            "The model: a local directory or `.gguf` file; a Hugging Face Hub id (`org/name`; `org/repo:Q4_K_M` "
            "for one file of a GGUF repository), downloaded at start into the Hugging Face cache; or an "
            "`s3://bucket/prefix` or `gs://bucket/prefix` URL, downloaded into `download_dir`. Unset = Vertex AI's "
            "`AIP_STORAGE_URI` when set, else the bundled default model (SmolLM2-135M-Instruct). See docs/models.md."
        ),
    )
    model_name: str | None = Field(
        None, description="Model name reported by `/models` and `/ping`; unset = derived from `model_id`."
    )
    served_model_name: str | None = Field(
        None,
        description=(
            "Other names the OpenAI routes accept as `model`, comma-separated (as vLLM's "
            "`--served-model-name`); `*` accepts any name. Always accepted: the model's name, no `model` "
            "at all, `tgi` and `dummy` (what TGI's clients send), and for the bundled default model "
            "`SmolLM2`, `smollm`, `smollm2` and `HuggingFaceTB/SmolLM2-135M-Instruct`; any other `model` "
            "answers 404. See docs/protocols/openai.md."
        ),
    )
    revision: str | None = Field(None, description="Revision (branch, tag or commit) of a Hugging Face Hub model id.")
    gguf_file: str | None = Field(
        None,
        description=(
            "The `.gguf` file to fetch from a Hub repository of GGUF files (`model_id=org/repo`), instead of a "
            "`:QUANT` tag on the id; without either, a GGUF repository's Q4_K_M file (llama.cpp's default)."
        ),
    )
    download_dir: str | None = Field(
        None,
        description=(
            "Where `s3://` and `gs://` models are downloaded to (one directory a URL, kept between starts); unset = "
            "the user cache dir / `lmiserve/downloads`. Hub models go to the Hugging Face cache (`HF_HOME`, "
            "`HF_HUB_CACHE`)."
        ),
    )
    download_part_size: ByteSize = Field(
        ByteSize(16 << 20),
        ge=4096,
        description=(
            "Bytes one ranged GET of a model download reads (`16MiB`; `64KiB`, `1GB` ... accepted): eight parts "
            "download at a time, and a killed download resumes after the last part written."
        ),
    )
    download_retries: int = Field(
        4,
        ge=0,
        le=20,
        description=(
            "Attempts after the first when a model download meets a network error (no connection, a timeout, "
            "a 429 or 5xx), waiting 1, 2, 4, ... seconds (at most 30) between them."
        ),
    )
    dtype: Dtype = Field(
        "auto",
        description=(
            "Weights and compute dtype: `auto` (fp32 on CPU, bf16/fp16 on GPU), `fp32`, `fp16`, `bf16`, `int8` "
            "(CPU: weight-only int8 linear layers, bf16 activations and KV cache) or `int4` (CPU: linear "
            "layers in 4-bit groups of 32 as GGUF Q4_1, fp32 activations and KV cache; the fastest single "
            "stream). `float32`, `float16`, `half` and `bfloat16` are accepted too. See "
            "docs/performance/dtypes.md."
        ),
    )
    load_format: LoadFormat = Field(
        "auto",
        description=(
            "`auto` (or `safetensors`, `pt`): the weights in the model directory; `dummy` (vLLM's name): "
            "random weights from the directory's `config.json` (and its tokenizer), so memory and speed of "
            "a 1B or 8B shape can be measured without its weights. The output of a `dummy` model is noise."
        ),
    )
    device: str = Field(
        "auto",
        description="Device: `auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`.",
        json_schema_extra={"allowed": "one of auto, cpu, cuda, cuda:N"},
    )
    tensor_parallel_degree: str | None = Field(
        None,
        description=(
            "Devices one model is split over (LMI's key; vLLM's `tensor_parallel_size`): a number of worker "
            "processes, one a device (GPUs with NCCL; CPU processes with gloo), each holding a shard of the "
            "weights and of the KV cache; `max`: every visible GPU (1 on a CPU). Over several nodes it counts "
            "the ranks of all of them. Llama-family models on the fast path (docs/tensor-parallel.md)."
        ),
        json_schema_extra={"allowed": "a positive whole number or max"},
    )
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes the tensor-parallel ranks run on (vLLM's `--nnodes`; torchrun's and LeaderWorkerSet's "
            "variables): node 0 serves HTTP, the others only compute. Every node runs the same command."
        ),
    )
    node_rank: int = Field(
        0, ge=0, description="This node's rank among `nnodes` (vLLM's `--node-rank`; 0: the leader, which serves HTTP)."
    )
    master_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Where the tensor-parallel ranks meet: the leader node's address (torchrun's MASTER_ADDR).",
    )
    master_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "The rendezvous port on `master_addr` (torchrun's MASTER_PORT); unset: a free port on one node, "
            "29500 over several."
        ),
    )
    step_timeout: float = Field(
        300.0,
        gt=0,
        description=(
            "Seconds a tensor-parallel step may take: past it the workers are taken as hung, the model turns "
            "unhealthy and `lmiserve serve` exits (code 4) for the orchestrator to restart it."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow a model repository to run its own Python code.")
    model_cache_dir: str | None = Field(
        None,
        description="Where the bundled GGUF model is converted to; unset = the user cache dir / `lmiserve`.",
    )
    model_kind: ModelKind = Field(
        "auto",
        description=(
            "`auto` (detected from the model files), `llm`, `embedding`, `classifier` (`regression`: a "
            "classifier with one label) or `torchscript`."
        ),
    )
    input_names: str | None = Field(
        None,
        description=(
            "TorchScript inputs, comma-separated in the order `forward()` takes them; unset = one input `input__0`."
        ),
    )
    input_dtypes: str | None = Field(
        None, description="V2 datatypes of the TorchScript inputs, comma-separated; unset = `FP32` each."
    )
    input_shapes: str | None = Field(
        None,
        description=(
            "Shapes of the TorchScript inputs: `;` between inputs, `,` between dims, `-1` = any size "
            "(e.g. `-1,4;-1`); unset = `-1` each."
        ),
    )
    output_names: str | None = Field(
        None,
        description=(
            "Names of the TorchScript outputs, comma-separated in the order `forward()` returns them; "
            "unset = `output__0`, `output__1`, ..."
        ),
    )
    output_dtypes: str | None = Field(
        None, description="V2 datatypes of the TorchScript outputs, comma-separated; unset = `FP32` each."
    )
    output_shapes: str | None = Field(
        None, description="Shapes of the TorchScript outputs, like `input_shapes`; unset = `-1` each."
    )
    # --- batching and limits ---
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
            "Run llama/mistral/qwen2 models with lmiserve's own fused forward (one pass per engine step); "
            "`false` forces the generic transformers path. Other models always use the generic path."
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
            "Most memory the prefix cache's KV blocks take, per model, in bytes (`536870912`) or with a unit "
            "(`512MiB`, `2GB`); least recently used blocks are evicted. `0` turns the cache off."
        ),
        json_schema_extra={"allowed": "a size >= 0 in bytes, e.g. 536870912, 512MiB or 2GB"},
    )
    kv_cache: KvCacheLayout = Field(
        "paged",
        description=(
            "The KV cache: `paged` (Engine v2: a pool of blocks sized by `kv_cache_memory_bytes`, admission by "
            "free blocks, preemption when the pool runs out, prompt chunks of several requests in one step, the "
            "prefix cache as shared blocks, sliding-window attention; every runner but the batch-invariant one, "
            "which keeps slots) or `slots` (one contiguous slot a sequence; it refuses sliding-window models). "
            "See docs/engine.md."
        ),
    )
    kv_cache_memory_bytes: ByteSize | None = Field(
        None,
        ge=1,
        description=(
            "Memory of the paged KV cache's pool, per model (per worker with tensor parallelism; vLLM's name), "
            "in bytes or with a unit (`4GiB`); unset = on CPU 25 % of the memory available at start-up, on CUDA "
            "`gpu_memory_utilization` of the GPU less what the model took and the activations of the largest "
            "step, profiled at start; never more than `max_rolling_batch_size` "
            "sequences at full context need. A request that needs more than the whole pool answers 4xx."
        ),
        json_schema_extra={"allowed": "a size >= 1 in bytes, e.g. 4294967296 or 4GiB (or empty for unset)"},
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Share of the GPU's memory lmiserve may take (LMI's and vLLM's name); sizes the paged KV pool.",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens a block of the paged KV cache holds (vLLM's name).")
    enforce_eager: bool = Field(
        False,
        description=(
            "On CUDA, run every step eagerly: no decode steps replayed as CUDA graphs (LMI's and vLLM's name). "
            "Graphs apply to the fast path over the paged KV cache on one GPU; see docs/engine.md."
        ),
    )
    # --- speculative decoding ---
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description=(
            "Speculative decoding, as vLLM's JSON object: `method` (`ngram`, `draft_model`, `self_draft`), "
            "`model`, `num_speculative_tokens`, `prompt_lookup_min`/`prompt_lookup_max`, the draft's `dtype`, "
            "`disable_by_batch_size`, `min_acceptance_rate`. Output is unchanged: greedy token for token, "
            "sampling from the model's own distribution. Paged KV cache only. See docs/speculative-decoding.md."
        ),
        json_schema_extra={"allowed": 'a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}'},
    )
    speculative_draft_model: str | None = Field(
        None,
        description=(
            "LMI's older key: the draft model's directory (as `speculative_config` with `method` "
            "`draft_model`); not with `speculative_config`."
        ),
    )
    speculative_length: int | None = Field(
        None, ge=1, le=16, description="LMI's older key: drafts a step verifies (with `speculative_draft_model`)."
    )
    # --- LoRA adapters ---
    enable_lora: bool = Field(
        False,
        description=(
            "Serve LoRA adapters on the model: registered at start (`lora_modules`, `lora_adapters`, an "
            "`adapters/` folder next to the model) or at run time (the adapters API). Implied by "
            "`lora_modules` and `lora_adapters`. Paged KV cache only. See docs/lora.md."
        ),
    )
    max_loras: int = Field(4, ge=1, le=256, description="Adapters that may run in one step (vLLM's `max_loras`).")
    max_lora_rank: int = Field(
        16, ge=1, le=1024, description="Highest LoRA rank an adapter may have; a higher one is refused when loaded."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description=(
            "Adapters kept loaded in memory (the least recently used one that no request uses and that is "
            "not pinned is dropped, and loads again when asked for); unset = `max_loras`, never fewer."
        ),
    )
    lora_modules: str | None = Field(
        None,
        description=(
            "Adapters at start, as vLLM names them: `name=path` items separated by spaces or commas, or JSON objects "
            '`{"name": ..., "path": ...}`.'
        ),
    )
    lora_adapters: str | None = Field(
        None,
        description=(
            "TGI's adapters at start (`LORA_ADAPTERS`): comma-separated `name=path` or `path` (named after its folder)."
        ),
    )
    # --- output ---
    output_formatter: OutputFormatter | None = Field(
        None,
        description=(
            "Default output format of LMI requests: `json`, `jsonlines`, `sse` or `tgi_compat`; "
            "unset = `json`, or `jsonlines` (`sse` with `tgi_compat`) when streaming."
        ),
    )
    tgi_compat: bool = Field(
        False,
        description="Answer LMI requests in Text Generation Inference shapes (list wrapper, details, SSE streaming).",
    )
    # --- server ---
    host: str = Field("0.0.0.0", description="Address the HTTP server listens on.")
    port: int = Field(8080, ge=1, le=65535, description="Port the HTTP server listens on.")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Also serve `GET /metrics` (Prometheus) on this port, without the API key; `/metrics` on the "
            "serving port stays, with the key when one is set (see docs/metrics.md and SECURITY.md)."
        ),
    )
    grpc_port: int = Field(
        8081,
        ge=0,
        le=65535,
        description=(
            "Port of the Open Inference Protocol over gRPC (KServe's `grpc_predict_v2`, the service Triton "
            "serves: `tritonclient.grpc`, KServe's `InferenceGRPCClient`), over the same models as REST; `0` = off. "
            "See docs/protocols/kserve.md."
        ),
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description=(
            "Export OpenTelemetry traces of every request to this OTLP collector (vLLM's `otlp_traces_endpoint`, "
            "TGI's `otlp_endpoint`), e.g. `http://otel-collector:4317`; also read from "
            "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and `OTEL_EXPORTER_OTLP_ENDPOINT`. Unset = no tracing (and no "
            "cost). See docs/tracing.md."
        ),
    )
    otlp_traces_protocol: OtlpProtocol = Field(
        "grpc",
        description=(
            "How traces reach the collector: `grpc` (OTLP/gRPC, port 4317) or `http/protobuf` (OTLP/HTTP, port "
            "4318; `/v1/traces` is added to an endpoint without a path)."
        ),
    )
    log_level: LogLevel = Field(
        "info", description="Log level: `debug` (also lists every option at start-up), `info`, `warning` or `error`."
    )
    log_format: LogFormat = Field(
        "text",
        description="`text`, or `json`: one JSON object per log line, for log pipelines (see docs/logs.md).",
    )
    request_id_header_key: str = Field(
        "X-Request-Id",
        pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
        description=(
            "Request header read first for a client's request id (then `X-Request-Id`, "
            "`X-Amzn-SageMaker-Inference-Id`, `X-Amzn-RequestId`); the response echoes the id under it as well "
            "as `X-Request-Id`. LMI's key: set it to `X-Amzn-SageMaker-Inference-Id` as DJL Serving does on "
            "SageMaker, though that header is read anyway."
        ),
        json_schema_extra={"allowed": "an HTTP header name"},
    )
    drain_timeout: float = Field(
        25.0,
        ge=0,
        description=(
            "Seconds a stopping server (SIGTERM or SIGINT) lets requests in flight (streams included) finish "
            "while every route but `/v2/health/live` answers 503; then it ends what still runs and exits 0. "
            "Keep it below the orchestrator's kill delay (SageMaker 30 s, Kubernetes "
            '`terminationGracePeriodSeconds`); see docs/shutdown.md, "Graceful drain".'
        ),
    )
    # --- TGI and OpenAI routes (docs/protocols/tgi.md, "Settings (TGI and OpenAI routes)") ---
    api_key: str | None = Field(
        None,
        description=(
            "When set, every route but the health and readiness probes requires "
            "`Authorization: Bearer <key>` (the Anthropic routes also take `x-api-key: <key>`; 401 in the "
            "protocol's shape otherwise); see SECURITY.md. "
            "Logged as `<hidden>`."
        ),
    )
    max_request_size: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description=(
            "Largest request body in bytes on every route (LMI's key and default, 64 MiB); a larger one gets "
            "413 in the protocol's shape, from `Content-Length` before anything is read, or as soon as a "
            "chunked body passes it."
        ),
    )
    max_header_size: int = Field(
        64 * 1024,
        ge=1024,
        description=(
            "Largest request headers in bytes (each header counts its name, value and 4); larger ones get 431 "
            "in the protocol's shape. A request head over 4 times this size is cut off with a bare 400."
        ),
    )
    enable_management_api: bool = Field(
        True,
        description=(
            "Serve LMI's management API (`GET/POST/DELETE /models`) and the LoRA adapters APIs (`/adapters`, "
            "`/models/{m}/adapters`, vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`); `false` "
            "removes those routes (404). Registration loads only from `model_store` or `allowed_model_paths`."
        ),
    )
    model_store: str | None = Field(
        None,
        description=(
            "Serve every model sub-directory of this directory (each named after its directory); `POST /models` "
            "may load models from it too (a relative `url` is taken relative to it)."
        ),
    )
    allowed_model_paths: str | None = Field(
        None,
        description=(
            "Comma-separated directories `POST /models` (and the adapters APIs) may also load from; a path "
            "outside them and `model_store` gets 403."
        ),
    )
    allowed_model_urls: str | None = Field(
        None,
        description=(
            "Remote models and adapters the management APIs may fetch (`POST /models?url=`, the adapters APIs): "
            "comma-separated URL prefixes such as `s3://my-bucket/models/`, `gs://my-bucket/`, `hf://my-org/` "
            "(a Hub id `org/name` is matched as `hf://org/name`). Unset = none: a caller can never make the "
            "server fetch a URL of its choosing. Models named at start are the operator's and need no entry."
        ),
    )
    max_concurrent_requests: int = Field(
        128,
        ge=1,
        description=(
            "TGI/OpenAI requests in flight at once; beyond it they get 429 `overloaded` at once (the "
            "`MAX_CONCURRENT_REQUESTS` environment variable sets LMI's `job_queue_size`, not this)."
        ),
    )
    max_best_of: int = Field(2, ge=1, description="Largest TGI `best_of`.")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop sequences of a TGI/OpenAI request.")
    max_top_n_tokens: int = Field(5, ge=0, description="Largest TGI `top_n_tokens`.")
    max_logprobs: int = Field(
        20,
        ge=0,
        description=(
            "Largest OpenAI `logprobs` (completions), `top_logprobs` (chat) and vLLM's `prompt_logprobs` "
            "(vLLM's `--max-logprobs`); above it the request gets 400."
        ),
    )
    max_input_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "TGI/OpenAI longest prompt in tokens (at most `max_input_len` and below `max_total_tokens`); "
            "unset = `max_input_len` if set, else `max_total_tokens` - 1."
        ),
    )
    max_total_tokens: int | None = Field(
        None,
        ge=2,
        description=(
            "TGI/OpenAI limit on prompt + new tokens (TGI's `max_total_tokens`, vLLM's `max_model_len`); "
            "unset or larger = the model's context length. LMI routes always check against the model's context."
        ),
    )
    max_client_batch_size: int = Field(
        4,
        ge=1,
        description=(
            "TGI's `max_client_batch_size`, reported by TGI's `/info`; OpenAI's `/v1/completions` takes up to "
            "`max_rolling_batch_size` (vLLM's `max_num_seqs`) prompts instead."
        ),
    )
    payload_limit: int = Field(
        2_000_000, ge=1, description="Largest TGI/OpenAI request body in bytes; a larger one gets 413."
    )
    sse_keepalive_interval: float = Field(
        15.0, gt=0, description="Seconds without an event before a TGI/OpenAI stream sends a `:` keep-alive comment."
    )
    strict_openai_fields: bool = Field(
        False,
        description=(
            "OpenAI chat and completions: refuse (400) a request with fields the server would accept and ignore "
            "(unknown keys, `user`, ...); off = answer it and name them in the `warnings` response header. "
            'See docs/protocols/openai.md, "Ignored fields".'
        ),
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description=(
            "Chat: split a reasoning model's thinking from its answer (OpenAI's `reasoning_content`, Anthropic's "
            "`thinking` blocks) in its family's format, by vLLM's `--reasoning-parser` names: `deepseek_r1`, "
            "`qwen3`, `glm45`, ... (`<think>`/`</think>`), `seed_oss`, `mistral` (`[THINK]`), `granite` "
            "(`Here is my thought process:`), `openai_gptoss` (harmony's analysis channel); unset = off unless "
            '`reasoning_end` is set. See docs/protocols/openai.md, "Reasoning models".'
        ),
    )
    reasoning_start: str | None = Field(
        None, description="Start marker of the reasoning block (overrides the `reasoning_parser` preset's)."
    )
    reasoning_end: str | None = Field(
        None,
        description=(
            "End marker of the reasoning block (overrides the preset's); without a preset it turns the reasoning "
            "parser on (with no start marker the output always starts in the reasoning)."
        ),
    )
    reasoning_effort_budgets: str = Field(
        "minimal:256,low:1024,medium:none,high:none",
        description=(
            "OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) as thinking budgets, for chat "
            "templates that do not read `reasoning_effort` themselves: `effort:tokens` items (`none`: no bound); "
            "the engine closes the reasoning block after that many tokens. Effort `none` always turns thinking "
            'off (budget 0). See docs/protocols/openai.md, "Reasoning models".'
        ),
        json_schema_extra={
            "allowed": "comma-separated effort:tokens items (effort minimal, low, medium or high; tokens a "
            "whole number or none)"
        },
    )
    tool_call_parser: ToolCallParser = Field(
        "auto",
        description=(
            "How the model writes tool calls (vLLM's `--tool-call-parser` names): `hermes`, `qwen3_coder`, "
            "`llama3_json`, `llama4_pythonic`, `pythonic`, `mistral`, `deepseek_v3`, `granite`, `openai` (gpt-oss "
            "harmony), or `json` (lmiserve's own format, for templates with none); `auto` picks one from the chat "
            "template's tool-call markers and logs the pick (`/info` names it). See docs/structured-output.md."
        ),
    )
    enable_auto_tool_choice: bool = Field(
        True,
        description=(
            'Whether `tool_choice: "auto"` (the default with tools) lets the model call tools; false refuses it '
            "with a 400, as vLLM does without its `--enable-auto-tool-choice`."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "The chat template to use instead of the tokenizer's: a Jinja file's path or the template text "
            "(vLLM's `--chat-template`)."
        ),
    )
    responses_store_size: int = Field(
        1000,
        ge=0,
        description=(
            "OpenAI Responses API: most responses kept in memory for `previous_response_id` and "
            "`GET /v1/responses/{id}` (least recently used dropped first); 0 stores none."
        ),
    )
    # --- SageMaker and Vertex AI (docs/protocols/sagemaker.md and docs/protocols/vertex.md, "Reference") ---
    default_invocations_accept: str | None = Field(
        None,
        description=(
            "Response type of `/invocations` when a request's `Accept` is missing or `*/*` (`application/json`, "
            "`application/jsonlines` or `text/csv`); unset = the request's own Content-Type."
        ),
    )
    vertex_predict_route: str | None = Field(
        None,
        description=("Extra Vertex AI predict route; `/v1/endpoints/*/deployedModels/*:predict` always works."),
    )
    vertex_health_route: str | None = Field(
        None, description="Extra Vertex AI health route (200 `{}` once every model is ready)."
    )
    vertex_deployed_model_id: str | None = Field(
        None, description='`deployedModelId` in Vertex AI predict answers; unset = `""`.'
    )
    # --- bookkeeping, not configuration keys ---
    extra: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Unknown keys of serving.properties and the environment (e.g. LMI's engine, tensor_parallel_degree): "
            "kept, logged, unused. An unknown -o key is an error instead."
        ),
    )
    sources: dict[str, str] = Field(
        default_factory=dict, description="Where each non-default value came from, e.g. 'environment OPTION_DTYPE'."
    )

    # ------------------------------------------------------------------ coercion

    @field_validator(
        "trust_remote_code",
        "enable_streaming",
        "batch_invariant",
        "tgi_compat",
        "fast_path",
        "cpu_autotune",
        "enforce_eager",
        "enable_management_api",
        "enable_prefix_caching",
        mode="before",
    )
    @classmethod
    def _parse_bool(cls, value: Any) -> Any:
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
        return value

    @field_validator(
        "dtype",
        "rolling_batch",
        "output_formatter",
        "log_level",
        "log_format",
        "device",
        "model_kind",
        "reasoning_parser",
        "tool_call_parser",
        mode="before",
    )
    @classmethod
    def _normalize_word(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, str):
            return value
        word = value.strip().lower()
        if info.field_name == "rolling_batch" and word in LMI_ENGINE_NAMES:
            logger.info("rolling_batch=%s: using lmiserve's continuous-batching engine", word)
            return "lmi"
        return _WORD_ALIASES.get(info.field_name, {}).get(word, word)

    @field_validator("reasoning_effort_budgets")
    @classmethod
    def _check_effort_budgets(cls, value: str) -> str:
        parse_effort_budgets(value)
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: Any) -> Any:
        return parse_speculative_config(value)

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _check_tensor_parallel(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value).strip().lower()
        if text == "max":
            return text
        if not text.isdigit() or int(text) < 1:
            raise ValueError("expected a positive whole number or max")
        return str(int(text))

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value in ("auto", "cpu") or _CUDA_DEVICE.fullmatch(value):
            return value
        raise ValueError("unknown device")

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} is larger than max_new_tokens_limit={self.max_new_tokens_limit}"
            )
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port={self.metrics_port} must differ from port (the serving port)")
        if self.batch_size > 1 and self.enable_streaming:
            raise ValueError(
                f"batch_size={self.batch_size} cannot be combined with enable_streaming=true: "
                "streaming without rolling batch needs batch_size=1"
            )
        if self.batch_size > 1 and self.rolling_batch != "disable":
            if "rolling_batch" in self.sources:
                logger.warning(
                    "batch_size=%d forces rolling_batch=disable (was %s)",
                    self.batch_size,
                    self.rolling_batch,
                )
            self.rolling_batch = "disable"
            self.sources["rolling_batch"] = f"batch_size={self.batch_size}"
        self._fold_lmi_speculative()
        self._check_step_budget()
        if self.lora_modules is not None or self.lora_adapters is not None:
            self.start_adapters()  # checked here: a bad value stops the start
            if not self.enable_lora:
                self.enable_lora = True
                self.sources.setdefault("enable_lora", "lora_modules" if self.lora_modules else "lora_adapters")
        if self.enable_lora and (self.kv_cache != "paged" or self.batch_invariant):
            raise ValueError("LoRA adapters need the paged KV cache: not with kv_cache=slots or batch_invariant=true")
        if self.speculative_config is not None and (self.kv_cache != "paged" or self.batch_invariant):
            raise ValueError(
                "speculative_config needs the paged KV cache: not with kv_cache=slots or batch_invariant=true"
            )
        self._check_parallel()
        return self

    def _check_step_budget(self) -> None:
        """A step's token budget must hold a decode row of every sequence that may run (vLLM refuses it too)."""
        budget = self.max_num_batched_tokens
        if self.dynamic_batching:
            running, limit = self.batch_size, f"batch_size={self.batch_size}"
        else:
            running = self.max_rolling_batch_size
            limit = f"max_rolling_batch_size={running} (vLLM's max_num_seqs)"
        if budget is not None and budget < running:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than {limit}: a step must hold a token of every "
                "running sequence"
            )

    def _check_parallel(self) -> None:
        """Tensor parallelism's options: the nodes' arithmetic, and (for a number of ranks; `max` is checked
        once the GPUs are counted, `tensor_parallel_conflict`) what it does not combine with."""
        degree = self.tensor_parallel_degree
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be below nnodes={self.nnodes}")
        if degree is None or degree == "max" or int(degree) == 1:
            if self.nnodes > 1:
                raise ValueError(f"nnodes={self.nnodes} needs tensor_parallel_degree set to the ranks of all nodes")
            return
        ranks = int(degree)
        if ranks % self.nnodes:
            raise ValueError(f"tensor_parallel_degree={ranks} is not a multiple of nnodes={self.nnodes}")
        conflict = self.tensor_parallel_conflict(ranks)
        if conflict is not None:
            raise ValueError(conflict)

    def tensor_parallel_conflict(self, ranks: int) -> str | None:
        """Why these settings cannot run over `ranks` tensor-parallel ranks (None: they can)."""
        refused = [
            ("enable_lora", self.enable_lora),
            ("kv_cache=slots", self.kv_cache != "paged"),
            ("batch_invariant", self.batch_invariant),
            ("dtype int8/int4", self.dtype.strip().lower() in ("int8", "int4")),
            ("fast_path=false", not self.fast_path),
            (
                "speculative decoding with a draft model",
                self.speculative_config is not None and self.speculative_config.method != "ngram",
            ),
        ]
        for what, present in refused:
            if present:
                return f"tensor_parallel_degree={ranks} cannot be combined with {what}"
        return None

    def start_adapters(self) -> list[tuple[str, str]]:
        """The adapters `lora_modules` and `lora_adapters` name, as (name, path) pairs."""
        pairs = parse_lora_modules(self.lora_modules or "") + parse_lora_adapters(self.lora_adapters or "")
        names = [name for name, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"adapter {twice[0]!r} is named by both lora_modules and lora_adapters")
        return pairs

    def _fold_lmi_speculative(self) -> None:
        """LMI's `speculative_draft_model` / `speculative_length` as a `speculative_config`."""
        draft, length = self.speculative_draft_model, self.speculative_length
        if draft is None and length is None:
            return
        if self.speculative_config is not None:
            raise ValueError("give speculative_config or speculative_draft_model/speculative_length, not both")
        if draft is None:
            raise ValueError("speculative_length needs speculative_draft_model (or use speculative_config)")
        self.speculative_config = SpeculativeConfig(
            method="draft_model", model=draft, num_speculative_tokens=length or LMI_SPECULATIVE_LENGTH
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def option_keys(cls) -> list[str]:
        """The configuration keys: every field except the bookkeeping ``extra`` and ``sources``."""
        return [name for name in cls.model_fields if name not in _META_FIELDS]

    @classmethod
    def from_options(cls, options: Mapping[str, object], sources: Mapping[str, str] | None = None) -> Settings:
        """Validate string (or typed) options; raise ``ConfigError`` on any bad value.

        Keys may carry ``option.`` or be LMI aliases. An empty value means "use the default".
        Unknown keys go to ``extra`` with a warning. ``sources`` maps keys to where they came from.
        """
        known = set(cls.option_keys())
        where = {canonical_key(key): source for key, source in (sources or {}).items()}
        values: dict[str, object] = {}
        extra: dict[str, str] = {}
        for raw_key, value in options.items():
            key = canonical_key(raw_key)
            if key not in known:
                extra[key] = str(value)
            elif value is None or (isinstance(value, str) and not value.strip()):
                values.pop(key, None)
            else:
                values[key] = value.strip() if isinstance(value, str) else value
        if extra:
            logger.warning(unknown_options_warning(extra, where))
        used = {key: where[key] for key in [*values, *extra] if key in where}
        try:
            return cls.model_validate({**values, "extra": extra, "sources": used})
        except ValidationError as exc:
            raise ConfigError(describe_errors(exc.errors(), cls.model_fields, where)) from None

    # ------------------------------------------------------------------ derived

    @property
    def dynamic_batching(self) -> bool:
        """True when requests are batched statically (LMI's non-rolling mode), not continuously."""
        return self.rolling_batch == "disable" or self.batch_size > 1

    def model_roots(self) -> list[Path]:
        """The directories POST /models may load from: model_store and allowed_model_paths, resolved."""
        given = [self.model_store, *(self.allowed_model_paths or "").split(",")]
        return [Path(p.strip()).expanduser().resolve() for p in given if p and p.strip()]

    def resolved_model_cache_dir(self) -> Path:
        """``model_cache_dir``, or the platform's user cache dir / lmiserve."""
        if self.model_cache_dir:
            return Path(self.model_cache_dir).expanduser()
        import platformdirs

        return Path(platformdirs.user_cache_dir("lmiserve"))

    def summary(self) -> list[str]:
        """``key=value (from <source>)`` or ``key=value (default)`` per key: the start-up log at debug level."""
        lines = []
        for key in self.option_keys():
            source = self.sources.get(key)
            origin = f"from {source}" if source else "default"
            lines.append(f"{key}={self._shown(key)} ({origin})")
        for key, value in self.extra.items():
            lines.append(f"{key}={value} (ignored{_from(self.sources.get(key))})")
        return lines

    def changed(self) -> list[str]:
        """``key=value (<source>)`` for every key whose value is not its default: the start-up log."""
        lines = []
        for key in self.option_keys():
            field = type(self).model_fields[key]
            if getattr(self, key) == field.get_default(call_default_factory=True):
                continue
            lines.append(f"{key}={self._shown(key)} ({self.sources.get(key, 'set')})")
        return lines

    def _shown(self, key: str) -> object:
        return "<hidden>" if key == "api_key" and self.api_key else getattr(self, key)


def unknown_options_warning(extra: Mapping[str, str], where: Mapping[str, str]) -> str:
    """One line naming every unknown key, where it came from, and what it may have meant."""
    parts = []
    for key in extra:
        notes = [note for note in (unknown_key_note(key), _from(where.get(key)).strip()) if note]
        parts.append(f"{key!r} ({'; '.join(notes)})" if notes else repr(key))
    if len(parts) == 1:
        return f"ignoring unknown option {parts[0]}"
    return f"ignoring {len(parts)} unknown options: {', '.join(parts)}"


def _from(source: str | None) -> str:
    return f" from {source}" if source else ""
