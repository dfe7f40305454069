"""How options may be spelled: LMI's and vLLM's other names of a key (``KEY_ALIASES``), the LMI keys
lmiserve ignores (``LMI_IGNORED_KEYS``), LMI's engine names and words (booleans, dtypes, log levels)."""

from __future__ import annotations

from lmiserve.config.properties import strip_option_prefix

# Other spellings of the same key: LMI's, and vLLM's engine arguments (LMI passes option.<vLLM argument> on).
KEY_ALIASES: dict[str, str] = {
    "max_dynamic_batch_size": "batch_size",  # LMI
    "max_num_seqs": "max_rolling_batch_size",  # vLLM
    "max_model_len": "max_total_tokens",  # vLLM: prompt + output tokens
    "tensor_parallel_size": "tensor_parallel_degree",  # vLLM
    "quantization": "quantize",  # vLLM (LMI and TGI: quantize)
}

# LMI (DJL Serving) keys that lmiserve accepts in serving.properties and OPTION_* variables and ignores:
# they choose another engine's features (parallelism, LoRA, Python handlers). They are kept
# in ``extra`` and named in the start-up warning; on the command line (-o) they are an error, like any
# unknown key.
LMI_IGNORED_KEYS = frozenset(
    {
        "engine",
        "entryPoint",
        "pipeline_parallel_degree",
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

# the words a boolean setting takes, and other spellings of a setting's words
TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})
WORD_ALIASES: dict[str | None, dict[str, str]] = {
    "dtype": {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"},
    "log_level": {"warn": "warning"},
    "kv_cache_dtype": {"bf16": "bfloat16"},
    # vLLM's names of its Marlin kernels for the same AWQ and GPTQ checkpoints, and of FBGEMM's fp8 checkpoints
    "quantize": {"awq_marlin": "awq", "gptq_marlin": "gptq", "fbgemm_fp8": "fp8"},
}


def canonical_key(key: str) -> str:
    """Drop ``option.`` and resolve aliases: ``option.max_dynamic_batch_size`` -> ``batch_size``."""
    key = strip_option_prefix(key.strip())
    return KEY_ALIASES.get(key, key)
