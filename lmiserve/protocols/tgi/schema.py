"""TGI wire models (reference tgi-openai.md §3, §4): the generate request and its parameters.

Lenient where harmless (unknown keys ignored, ``"stop": null`` accepted), strict on types: a body that
does not fit is rejected as TGI does, with 422 ``Failed to deserialize the JSON body ...``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


class TgiParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    best_of: int | None = Field(None, ge=0, le=UINT32)
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
    def _null_stop_is_empty(cls, value):
        return [] if value is None else value


class GenerateRequest(BaseModel):
    """Body of POST /generate, /generate_stream, / (with `stream`) and /tokenize."""

    model_config = ConfigDict(extra="ignore")

    inputs: StrictStr
    parameters: TgiParameters | None = None  # absent: do_sample defaults to true (TGI quirk, §3)
    stream: StrictBool = False

    def effective_parameters(self) -> TgiParameters:
        return self.parameters if self.parameters is not None else TgiParameters(do_sample=True)


def deserialize_message(exc) -> str:
    """The pydantic error as one line, after TGI's ``Failed to deserialize ...`` prefix."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "Failed to deserialize the JSON body into the target type: " + "; ".join(parts)
