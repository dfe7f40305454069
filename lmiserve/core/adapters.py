"""The LoRA adapter a request names, as each protocol names it (docs/lora.md, "Choosing an adapter per
request"): TGI's `parameters.adapter_id`, LMI's `adapters` / `parameters.adapter_id` / ``?adapter=`` /
SageMaker's adapter header, the `model` of OpenAI's and Anthropic's bodies, a tensor protocol's
`adapter_id` parameter. The protocol resolves the name before its response starts (so an unknown one is
its 404, never an in-band error of a stream that has begun) and sets `GenerationRequest.adapter`; the
engine holds the adapter while the request runs.

Not an adapter: an absent, null or empty name, and a name of the served model itself (the base model,
as vLLM answers its base model's name). The model's own names win over an adapter of the same name.
"""

from __future__ import annotations

from collections.abc import Collection, Container
from typing import Any

from lmiserve.core import request_context
from lmiserve.core.errors import AdapterNotFound, InvalidRequest, excerpt

__all__ = ["AdapterNotFound", "is_base", "noted", "resolve_adapter"]


def is_base(name: Any, model_names: Collection[str]) -> bool:
    """Whether `name` (a request's adapter field) means the base model: not given, empty, or one of the
    served model's own names."""
    return name in (None, "") or (isinstance(name, str) and name in model_names)


def resolve_adapter(
    name: Any, adapters: Container[str] | None, model_names: Collection[str], field: str = "adapter_id"
) -> str | None:
    """The adapter `name` selects: None for the base model (`is_base`), else the name of a registered
    adapter of `adapters` (the model's `AdapterRegistry`; None: it serves none). `AdapterNotFound` for
    any other name, `InvalidRequest` for a value that is not a name; `field` is the request field that
    carried it (named in the message). A selected adapter is noted in the request's access facts."""
    if is_base(name, model_names):
        return None
    if not isinstance(name, str):
        raise InvalidRequest(f"`{field}` must be an adapter's name (a string), not {excerpt(repr(name))}")
    if adapters is None:
        raise AdapterNotFound(
            f"`{field}` names adapter `{excerpt(name)}`, which is not served (this model serves no LoRA adapters)"
        )
    if name not in adapters:
        raise AdapterNotFound(f"`{field}` names adapter `{excerpt(name)}`, which is not served")
    return noted(name)


def noted(adapter: str | None) -> str | None:
    """`adapter`, noted in the current request's access facts (its access line's `adapter` field);
    returned unchanged."""
    if adapter is not None:
        request_context.note(adapter=adapter)
    return adapter
