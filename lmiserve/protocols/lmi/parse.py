"""LMI payloads -> `GenerationRequest`s and the options that format the answer.

Every parse failure raises `InvalidRequest` with LMI's message, answered as 424
``{"error": "Input Parsing failed. ...", "code": 424}``. The checks and their messages follow LMI's
order (docs/protocols/lmi.md). A LoRA adapter that is not served is `AdapterNotFound`, answered 404
``{"error": "...", "code": 404}`` (LMI itself answers ``Adapter NAME is not registered`` with its 424).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Container, Mapping
from dataclasses import dataclass
from typing import Any

from lmiserve.core import jsondoc
from lmiserve.core.adapters import noted, resolve_adapter
from lmiserve.core.errors import InvalidRequest, excerpt
from lmiserve.core.parameters import Limits, parse_parameters, to_sampling
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.protocols.lmi.formatters import FormatOptions, select_formatter_name

log = logging.getLogger(__name__)

PARSE_PREFIX = "Input Parsing failed. Ensure that the request payload is valid. "
ADAPTER_QUERY = "adapter"  # /invocations?adapter=NAME (LMI reads an `adapter` property of the request)
SAGEMAKER_ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


@dataclass(frozen=True)
class Outside:
    """An adapter named outside the body: `field` says where (the query parameter or the header)."""

    field: str
    name: str


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
    adapter: Outside | None = None,
) -> LmiCall:
    """`names`: `model_names` of the served model (as an adapter name, the base model); `adapters`: its
    LoRA adapters (None: it serves none); `adapter`: the adapter named outside the body (`outside_adapter`)."""
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
    chosen = _adapters(payload.get("adapters"), raw_params.get("adapter_id"), adapter, len(prompts), names, adapters)
    stream = bool(payload.get("stream", False))
    sampling = to_sampling(params, limits, stream)
    formatter = select_formatter_name(params.output_formatter, limits.output_formatter, stream, limits.tgi_compat)
    requests = [
        GenerationRequest(prompt, _copy(sampling), priority=params.priority, adapter=name)
        for prompt, name in zip(prompts, chosen)
    ]
    full_text = params.return_full_text if params.return_full_text is not None else dynamic_batch
    options = FormatOptions.for_request(
        requests[0], details=params.details, return_full_text=full_text, tgi_compat=limits.tgi_compat
    )
    return LmiCall(requests, stream, formatter, options)


def outside_adapter(query: Mapping[str, str], headers: Mapping[str, str]) -> Outside | None:
    """The adapter a request names outside its body, and where: the `adapter` query parameter, else
    SageMaker's `X-Amzn-SageMaker-Adapter-Identifier` header (an inference component of an adapter);
    None if neither names one."""
    if query.get(ADAPTER_QUERY):
        return Outside(ADAPTER_QUERY, query[ADAPTER_QUERY])
    if headers.get(SAGEMAKER_ADAPTER_HEADER):
        return Outside(SAGEMAKER_ADAPTER_HEADER, headers[SAGEMAKER_ADAPTER_HEADER])
    return None


def _adapters(
    body: Any,
    adapter_id: Any,
    outside: Outside | None,
    count: int,
    names: Collection[str],
    adapters: Container[str] | None,
) -> list[str | None]:
    """The adapter of each of `count` inputs (None: the base model). The first source that names one
    wins: the body's ``adapters`` (a name for every input, or a list of one per input), then
    ``parameters.adapter_id``, then `outside` (the query parameter, then SageMaker's header). Unknown
    names are `AdapterNotFound` (LMI's 404); a list of the wrong length or a value that is not a name
    LMI's 424."""
    try:
        if isinstance(body, list) and body:
            if len(body) != count:
                raise _fail(
                    f"Number of adapters is not equal to the number of inputs ({len(body)} adapters, {count} inputs)"
                )
            chosen = [resolve_adapter(name, adapters, names, "adapters") for name in body]
        elif body not in (None, "", []):
            chosen = [resolve_adapter(body, adapters, names, "adapters")] * count
        elif adapter_id not in (None, ""):
            chosen = [resolve_adapter(adapter_id, adapters, names, "adapter_id")] * count
        elif outside is not None:
            chosen = [resolve_adapter(outside.name, adapters, names, outside.field)] * count
        else:
            chosen = [None] * count
    except InvalidRequest as exc:
        if exc.message.startswith(PARSE_PREFIX):
            raise
        raise _fail(exc.message) from None
    distinct = sorted({name for name in chosen if name is not None})
    noted(",".join(distinct) or None)
    return chosen


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "stop_sequences": list(params.stop_sequences)})
