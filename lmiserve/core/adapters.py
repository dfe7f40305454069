"""LoRA adapters named by a request. None are served yet (a later issue), so a request that names an
adapter is refused instead of being answered by the base model, each protocol in its own error shape:
TGI's and LMI's ``adapter_id`` (LMI's ``adapters`` too) here, OpenAI's `model` as an unknown model (404).

Not an adapter: an absent, null or empty name, and a name of the served model itself (the base model,
as vLLM answers its base model's name)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from lmiserve.core.errors import AdapterNotFound, excerpt

__all__ = ["AdapterNotFound", "check_adapter", "not_served"]


def not_served(name: Any, model_names: Collection[str]) -> bool:
    """Whether `name` (a request's adapter field) names an adapter this server does not serve."""
    return name not in (None, "") and not (isinstance(name, str) and name in model_names)


def check_adapter(name: Any, model_names: Collection[str], field: str = "adapter_id") -> None:
    """`AdapterNotFound` when `name` names an adapter (no adapters are served); `field` is the request
    field that carried it."""
    if not_served(name, model_names):
        shown = excerpt(name if isinstance(name, str) else repr(name))
        raise AdapterNotFound(f"`{field}` names adapter `{shown}`, which is not served (no adapters are loaded)")
