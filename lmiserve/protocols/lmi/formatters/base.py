"""Formatter contract, options, registry and LMI's formatter selection rule.

A formatter is created per request and is the `lmiserve.server.pipeline.Encoder` of that request:
`get_formatter(name, options)` (name from `select_formatter_name(...)`), then
`pipeline.respond(request, events, formatter)`. The pipeline intercepts error finishes (a 424 before
the first byte, `formatter.error(exc)` after it); `on_event(index, event)` returns b"" when there is
nothing to send now; `streaming=False` formatters return the whole body from `close()`.

Selection: `parameters.output_formatter` of the request, else the server's `output_formatter`
option, else the default (`json`; `jsonlines` when streaming, `sse` when streaming under tgi_compat).

TGI compatibility is not a flag threaded through the code paths: each LMI format has a TGI
variant class registered as ``tgi_<name>``. `get_formatter` picks the variant when
`options.tgi_compat` is set, and `select_formatter_name` returns the variant's name directly.
The extra name ``tgi_compat`` (an lmiserve extension, not an LMI value) selects TGI output in
whatever shape suits the request: ``tgi_json`` when not streaming, ``tgi_sse`` when streaming.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from lmiserve.core.errors import LmiServeError
from lmiserve.core.events import StepEvent
from lmiserve.core.request import GenerationRequest
from lmiserve.protocols.lmi.errors import RENDERER

logger = logging.getLogger(__name__)

TGI_ALIAS = "tgi_compat"
TGI_PREFIX = "tgi_"


@dataclass
class FormatOptions:
    """What a formatter needs to know about the request, beyond the events."""

    details: bool | None = None  # parameters.details; None = not given (then True under TGI)
    return_full_text: bool = False
    tgi_compat: bool = False  # option.tgi_compat: pick the TGI variant of the named format
    prompt: str = ""  # for details.inputs and return_full_text; "" = use Finish.prompt
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    n: int = 1
    best_of: int = 1  # best_of/n/num_beams > 1 -> the best_of body shape

    @classmethod
    def for_request(
        cls,
        request: GenerationRequest,
        *,
        details: bool | None = None,
        return_full_text: bool = False,
        tgi_compat: bool = False,
    ) -> FormatOptions:
        p = request.params
        return cls(
            details=details,
            return_full_text=return_full_text,
            tgi_compat=tgi_compat,
            prompt=request.prompt,
            decoder_input_details=p.decoder_input_details,
            top_n_tokens=p.top_n_tokens,
            n=p.n,
            best_of=p.best_of,
        )


class Formatter(ABC):
    """Turns one request's events into bytes, incrementally (a pipeline `Encoder`). The input index
    of `on_event` is always 0 here (one request); `event.index` tells its sequences apart."""

    name: ClassVar[str] = ""
    content_type: str  # exactly as sent, no charset parameter (set by each class)
    streaming: bool  # True: send each chunk as it comes; False: one body at the end (set by each class)

    def __init__(self, options: FormatOptions):
        self.options = options

    @abstractmethod
    def on_event(self, index: int, event: StepEvent) -> bytes:
        """Bytes to send for this event now (b"" when nothing)."""

    @abstractmethod
    def close(self) -> bytes:
        """Called once after the last event: the remaining bytes (the whole body if not streaming)."""

    def error(self, exc: LmiServeError) -> bytes:
        """The in-band error that ends a stream after its first bytes were sent."""
        return RENDERER.in_band(exc)


def dumps(obj: Any) -> str:
    """LMI's JSON spelling: `", "` and `": "` separators, non-ASCII as raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False)


# --- registry ----------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Formatter]] = {}
F = TypeVar("F", bound=type[Formatter])


def register(name: str) -> Callable[[F], F]:
    """Class decorator: make a formatter selectable by `name`."""

    def deco(cls: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"formatter {name!r} already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def formatter_names() -> list[str]:
    return sorted(_REGISTRY)


def get_formatter(name: str, options: FormatOptions) -> Formatter:
    """Instantiate a registered formatter; with `options.tgi_compat` its TGI variant if any."""
    if options.tgi_compat and not name.startswith(TGI_PREFIX) and TGI_PREFIX + name in _REGISTRY:
        name = TGI_PREFIX + name
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown output formatter {name!r}") from None
    return cls(options)


def default_formatter_name(stream: bool, tgi_compat: bool) -> str:
    """LMI default: stream ? (tgi_compat ? sse : jsonlines) : json."""
    if not stream:
        return "json"
    return "sse" if tgi_compat else "jsonlines"


def select_formatter_name(request_value: str | None, option_value: str | None, stream: bool, tgi_compat: bool) -> str:
    """Resolve the formatter: parameters.output_formatter > option.output_formatter > default.

    Returns a registered name (the ``tgi_`` variant when `tgi_compat` applies). An unknown value
    is logged as a warning and the default rule applies (it does not fall back to the option).
    An empty string counts as unset.
    """
    value = request_value or option_value
    if value == TGI_ALIAS:
        tgi_compat, name = True, ("sse" if stream else "json")
    elif value in _REGISTRY:
        name = value
    else:
        if value:
            logger.warning("Unsupported output formatter: %s", value)
        name = default_formatter_name(stream, tgi_compat)
    if tgi_compat and not name.startswith(TGI_PREFIX) and TGI_PREFIX + name in _REGISTRY:
        name = TGI_PREFIX + name
    return name
