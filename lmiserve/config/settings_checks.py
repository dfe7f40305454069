"""The settings' checks across field groups: the coercion of words and booleans from text, and the
cross-field checks (what does not combine, what one setting implies for another), on
``CheckedSettings``, every field group together; ``Settings`` (settings.py) adds the bookkeeping and
the construction from options."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from lmiserve.config.settings_engine import EngineFields
from lmiserve.config.settings_media import MediaFields
from lmiserve.config.settings_model import ModelFields, ModelKindFields
from lmiserve.config.settings_parallel import LoraFields, SpeculativeFields, TensorParallelFields
from lmiserve.config.settings_routes import OutputFields, RouteFields
from lmiserve.config.settings_server import ServerFields
from lmiserve.config.spellings import FALSE_WORDS, LMI_ENGINE_NAMES, TRUE_WORDS, WORD_ALIASES

# the settings' log lines keep one logger name, whichever module of lmiserve.config writes them
logger = logging.getLogger("lmiserve.config.settings")


# pydantic collects fields along the reversed MRO: the last base's fields come first, a class's own
# fields last. The groups are listed last to first so the keys keep their order (model_id first, the
# bookkeeping `extra` and `sources` last): `Settings.option_keys()` and the start-up log follow it.
class CheckedSettings(
    MediaFields,
    RouteFields,
    ServerFields,
    OutputFields,
    LoraFields,
    SpeculativeFields,
    EngineFields,
    ModelKindFields,
    TensorParallelFields,
    ModelFields,
):
    """Every setting, coerced from text and checked across groups."""

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
        "async_scheduling",
        "enable_management_api",
        "enable_prefix_caching",
        "allow_private_media_urls",
        mode="before",
    )
    @classmethod
    def _parse_bool(cls, value: Any) -> Any:
        if isinstance(value, str):
            word = value.strip().lower()
            if word in TRUE_WORDS:
                return True
            if word in FALSE_WORDS:
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
        "kv_cache_dtype",
        "quantize",
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
        return WORD_ALIASES.get(info.field_name, {}).get(word, word)

    # ------------------------------------------------------------------ across groups

    @model_validator(mode="after")
    def _cross_checks(self) -> CheckedSettings:
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} is larger than max_new_tokens_limit={self.max_new_tokens_limit}"
            )
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port={self.metrics_port} must differ from port (the serving port)")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "fp16":
            raise ValueError(
                "kv_cache_dtype=bfloat16 under dtype=fp16 would round keys and values in the same memory: "
                "use auto, or fp8 for half of it"
            )
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
        if self.enable_lora and self.batch_invariant:
            raise ValueError(
                "LoRA adapters are not served with batch_invariant=true (it runs each request alone, as generate())"
            )
        if self.speculative_config is not None and self.batch_invariant:
            raise ValueError(
                "speculative_config is not served with batch_invariant=true (it runs each request alone, as generate())"
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
        refused = [  # LoRA adapters are served: each rank keeps its shard of them (engine/executors/tensor_parallel.py)
            ("batch_invariant", self.batch_invariant),
            ("dtype int8/int4", self.dtype.strip().lower() in ("int8", "int4")),
            ("fast_path=false", not self.fast_path),
        ]
        for what, present in refused:
            if present:
                return f"tensor_parallel_degree={ranks} cannot be combined with {what}"
        return None
