"""LMI payloads -> `GenerationRequest`s and the options that format the answer.

Every parse failure raises `InvalidRequest` with LMI's message, answered as 424
``{"error": "Input Parsing failed. ...", "code": 424}``. The checks and their messages follow LMI's
order (docs/protocols/lmi.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from lmiserve.core import jsondoc
from lmiserve.core.adapters import AdapterNotFound, check_adapter
from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.protocols.lmi.formatters import FormatOptions, select_formatter_name

log = logging.getLogger(__name__)

PARSE_PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "


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
    ``{"inputs": ""}``; anything else is JSON. `load` returns ``jsondoc.loads(body)`` (a caller that
    already parsed the body passes its cached result)."""
    ctype = (content_type or "").lower()
    if "text/plain" in ctype:
        return {"inputs": [body.decode("utf-8", errors="replace")]}
    if not ctype and not body.strip():
        return {"inputs": ""}
    try:
        return load() if load is not None else jsondoc.loads(body)
    except ValueError as exc:  # jsondoc's errors: not UTF-8, not JSON, nested too deeply, a lone surrogate
        raise _fail(str(exc)) from None


def model_names(service: Any) -> tuple[str, ...]:
    """The names that mean the served model itself (its name, `served_model_name`'s aliases): as an
    adapter name, the base model."""
    aliases = [a.strip() for a in (service.settings.served_model_name or "").split(",") if a.strip()]
    return (service.name, *aliases)


def parse(payload, limits: Limits, *, dynamic_batch: bool = False, names: Collection[str] = ()) -> LmiCall:
    """`names`: `model_names` of the served model (an adapter named otherwise is refused: none are served)."""
    if not isinstance(payload, dict) or payload.get("inputs") is None:
        raise _fail(
            "Invalid request payload. Request payload should be a json object specifying the 'inputs' "
            f"field. Received payload {excerpt(repr(payload))}"
        )
    inputs = payload["inputs"]
    if dynamic_batch and isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs):
        prompts = inputs
    elif isinstance(inputs, str):
        prompts = [inputs]
    else:
        raise _fail(f"Invalid request payload. The 'inputs' field must be a string. Received type {type(inputs)!r}")
    if any(p == "" for p in prompts):
        raise _fail(
            "Invalid request payload. The 'inputs' field does not contain any content. "
            f"Received payload {excerpt(repr(payload))}"
        )
    raw_params = payload.get("parameters", {})
    if raw_params is None:
        raw_params = {}
    if not isinstance(raw_params, dict):
        raise _fail(
            "Invalid request payload. 'parameters' must be provided as an object of key-value pairs. "
            f"Received payload {excerpt(repr(payload))}"
        )
    params = parse_parameters(raw_params)
    _check_adapters(payload.get("adapters"), raw_params.get("adapter_id"), names)
    stream = bool(payload.get("stream", False))
    sampling = to_sampling(params, limits, stream)
    formatter = select_formatter_name(params.output_formatter, limits.output_formatter, stream, limits.tgi_compat)
    requests = [GenerationRequest(prompt, _copy(sampling), priority=params.priority) for prompt in prompts]
    full_text = params.return_full_text if params.return_full_text is not None else dynamic_batch
    options = FormatOptions.for_request(
        requests[0], details=params.details, return_full_text=full_text, tgi_compat=limits.tgi_compat
    )
    return LmiCall(requests, stream, formatter, options)


def _check_adapters(adapters: Any, adapter_id: Any, names: Collection[str]) -> None:
    """LMI's ``adapters`` (a name, or one per input) and ``parameters.adapter_id``: until adapters are
    served, naming one is an invalid request (LMI's 424 ``Input Parsing failed``)."""
    try:
        for name in adapters if isinstance(adapters, list) else [adapters]:
            check_adapter(name, names, "adapters")
        check_adapter(adapter_id, names)
    except AdapterNotFound as exc:
        raise AdapterNotFound(PARSE_PREFIX + exc.message) from None


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "stop_sequences": list(params.stop_sequences)})
