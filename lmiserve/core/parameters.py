"""Generation parameters by their LMI / Hugging Face names (`max_new_tokens`, `temperature`,
`do_sample`, `stop`, ...): the `parameters` object of an LMI request, and what every tensor protocol
passes next to a prompt tensor. Validated into `SamplingParams` with the server's limits; a bad
value raises `InvalidRequest`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lmiserve.core import constraints
from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.grammar import Grammar
from lmiserve.core.request import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Server options that shape every request."""

    default_max_new_tokens: int = 30
    max_new_tokens_limit: int = 4096
    output_formatter: str | None = None
    tgi_compat: bool = False


class GenerationParameters(BaseModel):
    """Generation and formatting parameters by their LMI / Hugging Face names. Unknown keys are ignored
    (and logged)."""

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
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # vLLM's: the waiting queue admits lower values first
    output_formatter: str | None = None
    # structured output (lmiserve.core.constraints): DJL Serving's `json_schema`, TGI's `grammar`,
    # OpenAI's `response_format`, vLLM's `guided_*` / `structured_outputs`; one at most
    json_schema: Any = None
    grammar: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("stop_sequences", "stop", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: object) -> object:
        if isinstance(data, dict) and "min_tokens" in data and "min_new_tokens" not in data:
            data = {**data, "min_new_tokens": data["min_tokens"]}
        return data

    @property
    def unknown(self) -> list[str]:
        known = ("min_tokens", "watermark", "stream", "adapter_id")  # adapter_id: lmiserve.core.adapters
        return sorted(k for k in (self.model_extra or {}) if k not in known)

    @property
    def sampling(self) -> bool:
        """Greedy unless `do_sample` is true, or it is absent and a positive temperature is given."""
        if self.do_sample is not None:
            return self.do_sample and self.temperature != 0.0
        return self.temperature is not None and self.temperature > 0.0


def parse_parameters(raw: dict[str, Any]) -> GenerationParameters:
    try:
        params = GenerationParameters.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(_validation_message(exc)) from None
    if params.unknown:
        log.warning("ignoring unknown generation parameters: %s", ", ".join(params.unknown))
    return params


def to_sampling(params: GenerationParameters, limits: Limits, stream: bool) -> SamplingParams:
    max_new = params.max_new_tokens or limits.default_max_new_tokens
    if max_new > limits.max_new_tokens_limit:
        raise InvalidRequest(f"max_new_tokens must be <= {limits.max_new_tokens_limit}. Given: {max_new}")
    sampling = params.sampling
    n = params.n if params.n is not None else params.best_of
    if params.n is not None and params.best_of > 1 and n > params.best_of:
        raise InvalidRequest(f"`n` ({n}) must be <= `best_of` ({params.best_of})")
    count = max(n, params.best_of)
    if count > 1 and stream:
        raise InvalidRequest("`n` and `best_of` > 1 are not supported when streaming")
    if count > 1 and not sampling:
        raise InvalidRequest("`n` and `best_of` > 1 require sampling (`do_sample: true` or a positive `temperature`)")
    return SamplingParams(
        grammar=output_constraint(params),
        do_sample=sampling,
        seed=params.seed,
        temperature=params.temperature if sampling and params.temperature is not None else 1.0,
        top_k=max(params.top_k, 0),
        top_p=params.top_p,
        typical_p=params.typical_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_new_tokens=max_new,
        min_new_tokens=min(params.min_new_tokens, max_new),
        stop_sequences=list(params.stop_sequences) + list(params.stop or []),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos_token=params.ignore_eos_token,
        skip_special_tokens=params.skip_special_tokens,
        truncate=params.truncate,
        decoder_input_details=params.decoder_input_details,
        top_n_tokens=params.top_n_tokens,
        n=n,
        best_of=count,
    )


def output_constraint(params: GenerationParameters) -> Grammar | None:
    """The one structured-output constraint of `params`, whichever spelling carried it."""
    return constraints.only_one(
        constraints.json_schema(params.json_schema) if params.json_schema is not None else None,
        constraints.from_tgi(params.grammar) if params.grammar is not None else None,
        constraints.from_response_format(params.response_format),
        constraints.from_vllm(
            {name: getattr(params, name) for name in (*constraints.VLLM_FIELDS, "structured_outputs")}
        ),
    )


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "parameters"
        parts.append(f"Invalid value {excerpt(repr(err.get('input')))} for parameter '{where}': {err['msg']}")
    return "; ".join(parts)
