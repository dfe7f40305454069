"""The LoRA adapter a request names, as each protocol names it (docs/lora.md, "Choosing an adapter per
request"): TGI's `parameters.adapter_id`, LMI's `adapters` / `parameters.adapter_id` / ``?adapter=`` /
SageMaker's adapter header, the `model` of OpenAI's and Anthropic's bodies, a tensor protocol's
`adapter_id` parameter. Each protocol lists where its request names one (`Source`s, highest precedence
first; on the routes of the /invocations dispatcher also LMI's ways around the protocol's own field,
`Elsewhere`) and `select_adapter` picks it, before the response starts (so an unknown one is its 404,
never an in-band error of a stream that has begun); the protocol builds its `GenerationRequest` with it.
The engine holds the adapter while the request runs.

Not an adapter: an absent, null or empty name, and a name of the served model itself (the base model,
as vLLM answers its base model's name). The model's own names win over an adapter of the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable
from dataclasses import dataclass
from typing import Any

from lmiserve.core import request_context
from lmiserve.core.errors import AdapterNotFound, InvalidRequest, excerpt

__all__ = [
    "NOWHERE",
    "AdapterNotFound",
    "Elsewhere",
    "Source",
    "first_named",
    "is_base",
    "noted",
    "resolve_adapter",
    "select_adapter",
]


@dataclass(frozen=True)
class Source:
    """One place a request may name its adapter: the body field, query parameter or header (`field`, which
    an error names) and what the request holds there (any JSON value; None: absent)."""

    field: str
    value: Any = None

    @property
    def names(self) -> bool:
        """Whether it names anything (absent, null and empty name nothing)."""
        return self.value is not None and self.value != ""


@dataclass(frozen=True)
class Elsewhere:
    """Where a request names its adapter outside its protocol's own field (LMI's ways, on the routes of the
    /invocations dispatcher): `first` before that field (LMI's `adapters` on a TGI body), `last` after it,
    in their order (the `adapter` query parameter, then SageMaker's adapter header)."""

    first: Source | None = None
    last: tuple[Source, ...] = ()

    def around(self, *own: Source) -> list[Source]:
        """Every source in precedence order: `first`, the protocol's own (`own`), then `last`."""
        return [*((self.first,) if self.first is not None else ()), *own, *self.last]


NOWHERE = Elsewhere()  # a route that reads only its protocol's own fields


def first_named(sources: Iterable[Source]) -> Source | None:
    """The first of `sources` that names anything (None: none does)."""
    return next((source for source in sources if source.names), None)


def select_adapter(
    sources: Iterable[Source],
    adapters: Container[str] | None,
    model_names: Collection[str],
    *,
    other: Callable[[str], str | None] | None = None,
) -> str | None:
    """The LoRA adapter a request selects, whichever protocol carried it (None: the base model). `sources`:
    where the request may name it, highest precedence first; the first that names anything decides, as
    `resolve_adapter` reads it (its field named in the errors). `other`: what a name that is neither the
    model's nor an adapter's means, for a field that names models too (OpenAI's and Anthropic's `model`:
    their own 404, or the base model for a wildcard served name); without it `AdapterNotFound`."""
    source = first_named(sources)
    if source is None:
        return None
    name = source.value
    is_adapter = isinstance(name, str) and adapters is not None and name in adapters
    if other is not None and isinstance(name, str) and not is_base(name, model_names) and not is_adapter:
        return other(name)
    return resolve_adapter(name, adapters, model_names, source.field)


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
