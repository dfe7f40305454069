"""`speculative_config`: speculative decoding's options in vLLM's shape (a JSON object), and LMI's older
`speculative_draft_model` / `speculative_length` folded into it. The engine's own settings are
`lmiserve.engine.speculative.proposers.SpeculationSettings`; docs/speculative-decoding.md is the user's guide."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's methods lmiserve does not have (they need a trained head or a model's own MTP layers)
UNSUPPORTED_METHODS = frozenset({"eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix"})
DraftDtype = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]
_DTYPE_WORDS = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# on CPU a step of a few rows is still bound by reading the weights; from about this many rows verifying
# drafts costs real compute (benchmarks/README.md, "speculative decoding")
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config` keys that lmiserve uses; any other key is an error naming it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model", "self_draft"] | None = Field(
        None,
        description=(
            "`ngram` (prompt lookup), `draft_model` (a smaller model with the same tokenizer, or the target "
            "itself with a draft `dtype`) or `self_draft` (the target quantized to `dtype`, int4 by "
            "default); unset = `draft_model` when `model` is given, else `ngram`."
        ),
    )
    model: str | None = Field(None, description="The draft model's directory (draft_model); unset = the target.")
    num_speculative_tokens: int = Field(
        DEFAULT_NUM_SPECULATIVE_TOKENS, ge=1, le=16, description="Drafts a step verifies per request."
    )
    prompt_lookup_min: int | None = Field(None, ge=1, description="Shortest n-gram looked up (ngram; default 2).")
    prompt_lookup_max: int | None = Field(None, ge=1, description="Longest n-gram looked up (ngram; default 5).")
    dtype: DraftDtype = Field(
        "auto",
        description="The draft model's dtype; `int4`/`int8` (CPU) make the target its own fast draft.",
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description=(
            f"No drafts while more requests than this decode (vLLM's name); unset = "
            f"{DEFAULT_DISABLE_BY_BATCH_SIZE} on CPU, 32 on a GPU."
        ),
    )
    min_acceptance_rate: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description=(
            "A request whose drafts are accepted less often than this (running average) goes without them "
            "for a while (doubling, at most 64 steps), then is tried again."
        ),
    )
    draft_tensor_parallel_size: int | None = Field(None, ge=1, le=1, description="Only 1 (vLLM's key).")

    @model_validator(mode="before")
    @classmethod
    def _methods(cls, data: Any) -> Any:
        if isinstance(data, dict):
            method = data.get("method")
            if isinstance(method, str):
                word = method.strip().lower()
                if word in UNSUPPORTED_METHODS:
                    raise ValueError(
                        f"method {method!r} is not supported: use ngram, draft_model or self_draft "
                        "(docs/speculative-decoding.md)"
                    )
                data = {**data, "method": "ngram" if word in ("[ngram]", "prompt_lookup") else word}
            dtype = data.get("dtype")
            if isinstance(dtype, str):
                data = {**data, "dtype": _DTYPE_WORDS.get(dtype.strip().lower(), dtype.strip().lower())}
        return data

    @model_validator(mode="after")
    def _complete(self) -> SpeculativeConfig:
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        if self.method == "ngram":
            if self.model or self.dtype != "auto":
                raise ValueError("method ngram takes no model and no dtype: it drafts without a model")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            low = low if low is not None else min(2, high) if high is not None else 2
            high = high if high is not None else max(5, low)
            if low > high:
                raise ValueError(f"prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})")
            self.prompt_lookup_min, self.prompt_lookup_max = low, high
            return self
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min/prompt_lookup_max are ngram's: method {self.method} has none")
        if self.method == "self_draft":
            if self.model:
                raise ValueError("method self_draft drafts with the target itself: give no model")
            if self.dtype == "auto":
                self.dtype = "int4"
        elif self.model is None and self.dtype == "auto":
            raise ValueError("method draft_model needs a model, or a dtype (int4/int8) for the target as its own draft")
        return self

    @property
    def self_draft(self) -> bool:
        """The target drafts for itself (quantized)."""
        return self.method == "self_draft" or (self.method == "draft_model" and self.model is None)


def parse_speculative_config(value: Any) -> Any:
    """A JSON text (what `OPTION_SPECULATIVE_CONFIG`, serving.properties and `-o` give) as an object;
    anything else as it is, for pydantic to judge."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object: {exc.msg} at character {exc.pos}") from None
    return value
