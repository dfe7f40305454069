"""What the configuration reference (reference.py) says besides the settings' own descriptions: the
groups its settings tables show them in (``GROUPS``) and the page's prose (how the sources merge,
unknown keys, the environment, the flags, the start-up log), filled in by reference.py."""

from __future__ import annotations

# (title, one line about the group, its keys in the order shown). Every setting is in exactly one group.
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Model",
        "What is served and how it is loaded.",
        (
            "model_id",
            "model_name",
            "served_model_name",
            "revision",
            "gguf_file",
            "download_dir",
            "download_part_size",
            "download_retries",
            "dtype",
            "quantize",
            "device",
            "tensor_parallel_degree",
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "step_timeout",
            "load_format",
            "trust_remote_code",
            "model_kind",
            "model_cache_dir",
        ),
    ),
    (
        "Batching and engine",
        "How requests share the engine: continuous (rolling) or dynamic batching, the fast path, the prefix cache.",
        (
            "rolling_batch",
            "max_rolling_batch_size",
            "max_rolling_batch_prefill_tokens",
            "max_num_batched_tokens",
            "prefill_tokens_while_decoding",
            "job_queue_size",
            "predict_timeout",
            "batch_size",
            "max_batch_delay",
            "enable_streaming",
            "batch_invariant",
            "fast_path",
            "cpu_autotune",
            "autotune_cache",
            "num_threads",
            "enable_prefix_caching",
            "prefix_cache_size",
            "kv_cache",
            "kv_cache_memory_bytes",
            "gpu_memory_utilization",
            "enforce_eager",
            "cuda_graph_prompt_tokens",
            "async_scheduling",
            "stream_interval",
            "engine_process",
            "block_size",
            "kv_cache_dtype",
            "speculative_config",
            "speculative_draft_model",
            "speculative_length",
            "enable_lora",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "lora_modules",
            "lora_adapters",
        ),
    ),
    (
        "Request limits",
        "What one request may ask for; larger requests are refused in their protocol's error shape.",
        (
            "max_input_len",
            "max_new_tokens",
            "max_new_tokens_limit",
            "max_input_tokens",
            "max_total_tokens",
            "max_concurrent_requests",
            "max_client_batch_size",
            "max_best_of",
            "max_stop_sequences",
            "max_top_n_tokens",
            "max_logprobs",
            "max_request_size",
            "max_header_size",
            "payload_limit",
        ),
    ),
    (
        "Protocols and output",
        "Answer shapes of the LMI routes, streams, SageMaker and Vertex AI.",
        (
            "output_formatter",
            "tgi_compat",
            "sse_keepalive_interval",
            "strict_openai_fields",
            "reasoning_parser",
            "reasoning_start",
            "reasoning_end",
            "reasoning_effort_budgets",
            "tool_call_parser",
            "enable_auto_tool_choice",
            "chat_template",
            "responses_store_size",
            "default_invocations_accept",
            "vertex_predict_route",
            "vertex_health_route",
            "vertex_deployed_model_id",
        ),
    ),
    (
        "Vision",
        "Images in chat requests (docs/vision.md): how many and how large, and which http(s) image URLs the "
        "server may fetch.",
        (
            "limit_mm_per_prompt",
            "max_image_bytes",
            "max_image_pixels",
            "allowed_media_domains",
            "allow_private_media_urls",
            "media_fetch_timeout",
        ),
    ),
    (
        "Server and security",
        "Where the server listens, who may call it, what it logs, how it stops, which models it may load.",
        (
            "host",
            "port",
            "grpc_port",
            "metrics_port",
            "otlp_traces_endpoint",
            "otlp_traces_protocol",
            "api_key",
            "log_level",
            "log_format",
            "request_id_header_key",
            "drain_timeout",
            "keep_alive_timeout",
            "enable_management_api",
            "model_store",
            "allowed_model_paths",
            "allowed_model_urls",
        ),
    ),
    (
        "Tensor models",
        "Inputs and outputs of a TorchScript model (`model_kind=torchscript`) on the tensor protocols.",
        ("input_names", "input_dtypes", "input_shapes", "output_names", "output_dtypes", "output_shapes"),
    ),
)

INTRO = """\
Every setting can come from four places. Highest precedence first:

1. **command line**: `lmiserve serve -o max_rolling_batch_size=64`, or one of the
   [flags](#command-line-flags) such as `--max-rolling-batch-size 64` (a flag beats `-o` for the same key);
2. **environment**: `OPTION_<KEY>` (e.g. `OPTION_MAX_ROLLING_BATCH_SIZE=64`), `SERVING_<KEY>` and the
   [shortcuts](#environment-variables) such as `HF_MODEL_ID`;
3. **`serving.properties`**: the file given with `--properties`, else `serving.properties` in the model
   directory (`--model-dir`);
4. **defaults** (the [tables below](#settings)).

This deliberately differs from DJL Serving LMI, where `serving.properties` beats the environment: in
lmiserve an environment variable can override a file baked into an image. Keys may be written with or
without LMI's `option.` prefix (`option.dtype=bf16` and `dtype=bf16` are the same key); some keys also
have aliases, LMI's or vLLM's spelling, listed with the key. An empty value resets a key to its default;
empty environment variables are ignored. When a model directory is given and no source sets `model_id`,
the directory is the model (LMI's `/opt/ml/model` behaviour); without one, Vertex AI's `AIP_STORAGE_URI`
(a `gs://` URL or a path) is the model when it is set. Booleans accept `true/false`, `yes/no`,
`on/off`, `1/0` (any case).

A bad value stops the server before anything loads (exit status 2) with one line naming the key, the
value, what is allowed and where the value came from:

```text
{bad_value}
```

`lmiserve options` prints every key with its default and meaning (`lmiserve options --search WORD`
keeps the keys that mention WORD, `--markdown` prints this page); `lmiserve serve --help` lists the flags.
"""

UNKNOWN_KEYS = """\
A key lmiserve does not know is an error on the command line (`-o`): the server stops before anything
loads (exit status 2), naming the closest valid key when one is close:

```text
{unknown_cli}
```

In `serving.properties` and `OPTION_*`/`SERVING_*` variables an unknown key is allowed, because LMI's
files and containers carry keys meant for other engines: it is kept (unused) and the start-up log names
every such key in one warning line, each with where it came from and the key it may have meant:

```text
{unknown_files}
```

These LMI keys are known and ignored on purpose in `serving.properties` and the environment (one engine,
no Python handlers, no pipeline parallelism); with `-o` they are an error like any other unknown key:
{lmi_keys}. `OPTION_ENTRYPOINT` is read as LMI's `entryPoint`.
"""

ENVIRONMENT = """\
Every key `<key>` is set by `OPTION_<KEY>` and by `SERVING_<KEY>` (upper-cased; `OPTION_` wins). These
shortcuts, the names TGI, the Hugging Face LLM containers, SageMaker and Vertex AI use, set a key too,
below `OPTION_*` and `SERVING_*`:

{shortcuts}

When several variables set one key, the first one listed in the key's *Environment* cell below wins:
`OPTION_*`, then `SERVING_*`, then the shortcuts ({shortcut_order}), then the aliases' variables.
SageMaker sets `SAGEMAKER_BIND_TO_PORT` and Vertex AI `AIP_HTTP_PORT`; the two never come together.
"""

FLAGS = """\
`lmiserve serve` takes these settings as flags of their own; any other key is `-o KEY=VALUE`
(repeatable). A flag is the same source as `-o`, checked the same way (`--port http` fails like
`-o port=http`), and beats `-o` for the same key. Booleans take `--name` or `--no-name`.
vLLM's command line works as it is: `lmiserve serve MODEL` takes the model as `vllm serve MODEL` does (the
same as `--model-id`; giving two different models is an error), and vLLM's flags of the settings lmiserve
shares are flags here too (`--gpu-memory-utilization`, `--max-num-seqs`, `--quantization`,
`--served-model-name a b`: several names, as `served_model_name=a,b`).

{flags}

`--max-model-len` is vLLM's name: it sets `max_total_tokens`, the limit on prompt + new tokens of the
TGI and OpenAI routes, which is what vLLM's `max_model_len` limits. lmiserve cannot lengthen a model's
context, so a larger value means the model's context; the LMI routes always check prompt + new tokens
against the model's context, and `max_input_len` limits prompts on every route.

Besides the settings, `lmiserve serve` takes `--model-dir DIR` (a directory with `serving.properties`
and/or the weights, like `/opt/ml/model`), `--properties FILE` (a `serving.properties` file) and
`-o KEY=VALUE`.
"""

STARTUP = """\
At start-up lmiserve logs one line with the model(s), kind, dtype, device and the address it listens
on, and one line with only the options that differ from their defaults, each with where it came from
(`command line --port`, `environment OPTION_DTYPE`, `properties file ...`). With `--log-level debug`
it also logs every option, defaults included. `api_key` is always shown as `<hidden>`.
"""

EXAMPLES = """\
Ready-made files: `configs/cpu-demo.properties`, `configs/gpu-llama-bf16.properties`,
`configs/tgi-compatible.properties`, `configs/jsonlines-streaming.properties`; every key with its
default is in `serving.properties.example`.
"""
