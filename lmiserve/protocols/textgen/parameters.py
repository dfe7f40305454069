"""The generation parameters as TGI's generate request carries them; OpenAI requests are mapped onto
the same set before validation.

Lenient where harmless (unknown keys ignored, ``"stop": null`` accepted), strict on types: a value
that does not fit is a schema violation (TGI's 422 ``Failed to deserialize the JSON body ...``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


class TextGenParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    best_of: int | None = Field(None, ge=0, le=UINT32)
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)  # vLLM's extension: lower is admitted first
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: StrictBool = False
    max_new_tokens: int | None = Field(None, ge=0, le=UINT32)
    return_full_text: StrictBool | None = None
    stop: list[StrictStr] = Field(default_factory=list)
    truncate: int | None = Field(None, ge=0, le=UINT32)
    watermark: StrictBool = False
    details: StrictBool = False
    decoder_input_details: StrictBool = False
    seed: int | None = Field(None, ge=0, le=UINT64)
    top_n_tokens: int | None = Field(None, ge=0, le=UINT32)
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _null_stop_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value
