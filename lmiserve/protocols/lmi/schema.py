"""The LMI `parameters` object: names, defaults and bounds."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)


class LmiParameters(BaseModel):
    """Generation and formatting parameters of an LMI request. Unknown keys are ignored (and logged)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    do_sample: bool | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 17)
    temperature: float | None = Field(None, ge=0.0)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM) and 0 both mean disabled
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_new_tokens: int | None = Field(None, ge=1)
    min_new_tokens: int = Field(0, ge=0, validation_alias="min_new_tokens")
    stop_sequences: list[str] = Field(default_factory=list)
    stop: list[str] | None = None  # TGI / huggingface_hub spelling of stop_sequences
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos_token: bool = False
    skip_special_tokens: bool = True
    truncate: int | None = Field(None, ge=1)
    details: bool | None = None
    return_full_text: bool | None = None  # None: the mode's default (false; true for dynamic batching)
    decoder_input_details: bool = False
    top_n_tokens: int = Field(0, ge=0, le=20)
    n: int | None = Field(None, ge=1, le=16)  # None: as many as best_of (TGI/LMI)
    best_of: int = Field(1, ge=1, le=16)
    output_formatter: str | None = None

    @field_validator("stop_sequences", "stop", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data):
        if isinstance(data, dict) and "min_tokens" in data and "min_new_tokens" not in data:
            data = {**data, "min_new_tokens": data["min_tokens"]}
        return data

    @property
    def unknown(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in ("min_tokens", "watermark", "stream"))

    @property
    def sampling(self) -> bool:
        """Greedy unless `do_sample` is true, or it is absent and a positive temperature is given."""
        if self.do_sample is not None:
            return self.do_sample and self.temperature != 0.0
        return self.temperature is not None and self.temperature > 0.0
