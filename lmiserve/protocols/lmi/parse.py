"""LMI payloads -> `GenerationRequest`s and the options that format the answer.

Every parse failure raises `InvalidRequest` with LMI's message, answered as 424
``{"error": "Input Parsing failed. ...", "code": 424}``. The checks and their messages follow LMI's
order (docs/protocols/lmi.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lmiserve.core.errors import InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.protocols.lmi.formatters import FormatOptions, select_formatter_name
from lmiserve.protocols.lmi.schema import LmiParameters

log = logging.getLogger(__name__)

PARSE_PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "


@dataclass(frozen=True)
class Limits:
    """Server options that shape every request."""

    default_max_new_tokens: int = 30
    max_new_tokens_limit: int = 4096
    output_formatter: str | None = None
    tgi_compat: bool = False


@dataclass
class LmiCall:
    requests: list[GenerationRequest]
    stream: bool
    formatter: str
    options: FormatOptions


def _fail(detail: str) -> InvalidRequest:
    return InvalidRequest(PARSE_PREFIX + detail)


def decode_body(body: bytes, content_type: str | None, load: Callable[[], Any] | None = None) -> Any:
    """Body bytes -> payload, by Content-Type as LMI does: a Content-Type containing ``text/plain`` ->
    ``{"inputs": [text]}`` (a list, so rolling batch rejects it); no Content-Type and a blank body ->
    ``{"inputs": ""}``; anything else is JSON. `load` returns ``json.loads(body)`` (a caller that
    already parsed the body passes its cached result)."""
    ctype = (content_type or "").lower()
    if "text/plain" in ctype:
        return {"inputs": [body.decode("utf-8", errors="replace")]}
    if not ctype and not body.strip():
        return {"inputs": ""}
    try:
        return load() if load is not None else json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        detail = "the JSON document is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _fail(detail) from None


def parse(payload, limits: Limits, *, dynamic_batch: bool = False) -> LmiCall:
    if not isinstance(payload, dict) or payload.get("inputs") is None:
        raise _fail(
            "Invalid request payload. Request payload should be a json object specifying the 'inputs' "
            f"field. Received payload {payload!r}"
        )
    inputs = payload["inputs"]
    if dynamic_batch and isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs):
        prompts = inputs
    elif isinstance(inputs, str):
        prompts = [inputs]
    else:
        raise _fail(f"Invalid request payload. The 'inputs' field must be a string. Received type {type(inputs)!r}")
    if any(p == "" for p in prompts):
        raise _fail(f"Invalid request payload. The 'inputs' field does not contain any content. Received payload {payload!r}")
    raw_params = payload.get("parameters", {})
    if raw_params is None:
        raw_params = {}
    if not isinstance(raw_params, dict):
        raise _fail(
            "Invalid request payload. 'parameters' must be provided as an object of key-value pairs. "
            f"Received payload {payload!r}"
        )
    params = parse_parameters(raw_params)
    stream = bool(payload.get("stream", False))
    sampling = to_sampling(params, limits, stream)
    formatter = select_formatter_name(params.output_formatter, limits.output_formatter, stream, limits.tgi_compat)
    requests = [GenerationRequest(prompt, _copy(sampling)) for prompt in prompts]
    full_text = params.return_full_text if params.return_full_text is not None else dynamic_batch
    options = FormatOptions.for_request(
        requests[0], details=params.details, return_full_text=full_text, tgi_compat=limits.tgi_compat
    )
    return LmiCall(requests, stream, formatter, options)


def parse_parameters(raw: dict) -> LmiParameters:
    try:
        params = LmiParameters.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(_validation_message(exc)) from None
    if params.unknown:
        log.warning("ignoring unknown generation parameters: %s", ", ".join(params.unknown))
    return params


def to_sampling(params: LmiParameters, limits: Limits, stream: bool) -> SamplingParams:
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


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "stop_sequences": list(params.stop_sequences)})


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "parameters"
        parts.append(f"Invalid value {err.get('input')!r} for parameter '{where}': {err['msg']}")
    return "; ".join(parts)
