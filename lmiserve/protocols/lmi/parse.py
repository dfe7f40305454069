"""LMI payloads -> `GenerationRequest`s and the options that format the answer.

Every parse failure raises `InvalidRequest` with LMI's message, answered as 424
``{"error": "Input Parsing failed. ...", "code": 424}``. The checks and their messages follow LMI's
order (docs/protocols/lmi.md). A LoRA adapter that is not served is `AdapterNotFound`, answered 404
``{"error": "...", "code": 404}`` (LMI itself answers ``Adapter NAME is not registered`` with its 424).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass
from typing import Any

from lmiserve.core import jsondoc
from lmiserve.core.adapters import NOWHERE, Elsewhere, Source, noted, select_adapter
from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling
from lmiserve.core.request import GenerationRequest
from lmiserve.protocols.lmi.formatters import FormatOptions, select_formatter_name

log = logging.getLogger(__name__)

PARSE_PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "
ADAPTER_QUERY = "adapter"  # /invocations?adapter=NAME (LMI reads an `adapter` property of the request)
SAGEMAKER_ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"  # an inference component of an adapter


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


def parse(
    payload,
    limits: Limits,
    *,
    dynamic_batch: bool = False,
    names: Collection[str] = (),
    adapters: Container[str] | None = None,
    elsewhere: Elsewhere = NOWHERE,
) -> LmiCall:
    """`names`: `model_names` of the served model (as an adapter name, the base model); `adapters`: its
    LoRA adapters (None: it serves none); `elsewhere`: where the request names an adapter outside the body
    (the `adapter` query parameter, then SageMaker's header: `ADAPTER_QUERY`, `SAGEMAKER_ADAPTER_HEADER`)."""
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
    chosen = _adapters(payload.get("adapters"), raw_params.get("adapter_id"), elsewhere, len(prompts), names, adapters)
    stream = bool(payload.get("stream", False))
    sampling = to_sampling(params, limits, stream)
    formatter = select_formatter_name(params.output_formatter, limits.output_formatter, stream, limits.tgi_compat)
    requests = [  # immutable: one `sampling` for all
        GenerationRequest(prompt, sampling, priority=params.priority, adapter=name)
        for prompt, name in zip(prompts, chosen)
    ]
    full_text = params.return_full_text if params.return_full_text is not None else dynamic_batch
    options = FormatOptions.for_request(
        requests[0], details=params.details, return_full_text=full_text, tgi_compat=limits.tgi_compat
    )
    return LmiCall(requests, stream, formatter, options)


def adapters_source(value: Any) -> Source:
    """The body's ``adapters`` field as the source of the adapter of a request of one input: a name, or a
    list of one (an empty list names none; a longer one is no name)."""
    if isinstance(value, list) and len(value) <= 1:
        return Source("adapters", value[0] if value else None)
    return Source("adapters", value)


def _adapters(
    body: Any,
    adapter_id: Any,
    elsewhere: Elsewhere,
    count: int,
    names: Collection[str],
    adapters: Container[str] | None,
) -> list[str | None]:
    """The adapter of each of `count` inputs (None: the base model). The first source that names one
    wins: the body's ``adapters`` (a name for every input, or a list of one per input), then
    ``parameters.adapter_id``, then `elsewhere` (the query parameter, then SageMaker's header). Unknown
    names are `AdapterNotFound` (LMI's 404); a list of the wrong length or a value that is not a name
    LMI's 424."""
    try:
        if isinstance(body, list) and body:
            if len(body) != count:
                raise _fail(
                    f"Number of adapters is not equal to the number of inputs ({len(body)} adapters, {count} inputs)"
                )
            chosen = [select_adapter([Source("adapters", name)], adapters, names) for name in body]
        else:
            sources = elsewhere.around(adapters_source(body), Source("adapter_id", adapter_id))
            chosen = [select_adapter(sources, adapters, names)] * count
    except InvalidRequest as exc:
        if exc.message.startswith(PARSE_PREFIX):
            raise
        raise _fail(exc.message) from None
    distinct = sorted({name for name in chosen if name is not None})
    noted(",".join(distinct) or None)
    return chosen
