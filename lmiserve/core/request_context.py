"""The HTTP request being served, as whatever code serves it can see it: its id and the facts its access
line reports (lmiserve.server.access writes that line once, when the response is over).

`RequestFacts` is bound to a context variable for the whole life of one request, so any code running
for it (route, pipeline, model lookup, the engine's `submit`, the tasks of a streamed answer) reads the
request id with `current_request_id()` and adds what it learns with `note(...)` or `observe(...)`.
The engine's own loop is one task shared by every request: what it logs about a sequence names the
sequence's `GenerationRequest.request_id`, which is this id (see lmiserve.core.request).

The engine adds one `Generation` per generation request it ran for this request (`record_generation`):
what was asked and when it was queued, admitted, got its first token and ended, which the traces'
queue, prefill and decode spans are made of (lmiserve.server.tracing) once the request is over.
"""

from __future__ import annotations

import re
import time
import uuid
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

from lmiserve.core.events import StepEvent
from lmiserve.core.stats import RequestStats

CANCELLED = "cancelled"  # the finish reason of an answer its client left before the end
_USABLE_ID = re.compile(r"[!-~]{1,200}")  # no spaces or control characters: safe in a log line


def new_request_id() -> str:
    return uuid.uuid4().hex


def usable_request_id(value: str) -> bool:
    """1 to 200 visible ASCII characters: a client's request id that is safe in a log line."""
    return _USABLE_ID.fullmatch(value) is not None


@dataclass(frozen=True)
class Generation:
    """One generation request the engine ran for the HTTP (or gRPC) request being served (an LMI dynamic
    batch runs one per input): its settings, and its times and counts from the engine (`stats`)."""

    max_new_tokens: int
    temperature: float  # 0.0 for greedy decoding
    top_p: float
    stats: RequestStats


@dataclass
class RequestFacts:
    """One request, from its first byte in to its last byte out. Times are `time.monotonic()`."""

    request_id: str
    method: str = ""
    path: str = ""
    start: float = field(default_factory=time.monotonic)
    route: str | None = None  # the route's path template, once a route matched
    protocol: str | None = None  # the protocol that answered (the innermost route group's)
    model: str | None = None  # the model the request addressed
    adapter: str | None = None  # the LoRA adapter it selected (or, on the adapters API, manages)
    status: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of prompt_tokens, how many the prefix cache supplied
    generated_tokens: int | None = None
    first_token: float | None = None
    end: float | None = None
    finish_reasons: list[str] = field(default_factory=list)  # distinct, in the order seen
    completed: bool = False  # the response's last byte was handed to the server
    disconnected: bool = False  # the client went away before that
    generations: list[Generation] = field(default_factory=list)  # what the engine ran for it, in order
    trace_id: str | None = None  # its trace (32 hex digits) when tracing is on: the access line shows it
    _inputs: set[int] = field(default_factory=set, repr=False)

    def observe(self, index: int, event: StepEvent) -> None:
        """Note one engine event of input `index` (cheap: called for every token of a stream)."""
        if self.first_token is None and event.token is not None:
            self.first_token = time.monotonic()
        finish = event.finish
        if finish is None:
            return
        if index not in self._inputs:  # each input's prompt counts once, however many sequences it has
            self._inputs.add(index)
            self.prompt_tokens = (self.prompt_tokens or 0) + finish.prompt_tokens
            self.cached_tokens = (self.cached_tokens or 0) + finish.cached_tokens
        self.generated_tokens = (self.generated_tokens or 0) + finish.generated_tokens
        if finish.reason.value not in self.finish_reasons:
            self.finish_reasons.append(finish.reason.value)

    @property
    def finish_reason(self) -> str | None:
        """`cancelled` if the client left before the end, else the sequences' reasons (comma-joined)."""
        if self.disconnected and not self.completed:
            return CANCELLED
        return ",".join(self.finish_reasons) or None

    def fields(self) -> dict[str, Any]:
        """The access line's fields (times in seconds; None for what does not apply or is unknown)."""
        end = self.end if self.end is not None else time.monotonic()
        return {
            "method": self.method,
            "path": self.path,
            "route": self.route,
            "protocol": self.protocol,
            "model": self.model,
            "adapter": self.adapter,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "time_to_first_token": _seconds(self.first_token - self.start) if self.first_token is not None else None,
            "total_time": _seconds(end - self.start),
            "finish_reason": self.finish_reason,
            **({"trace_id": self.trace_id} if self.trace_id is not None else {}),
            "request_id": self.request_id,
        }


def _seconds(value: float) -> float:
    return round(value, 6)


_current: ContextVar[RequestFacts | None] = ContextVar("lmiserve_request", default=None)


def bind(facts: RequestFacts) -> Token[RequestFacts | None]:
    """Make `facts` the current request of this context (and of every task it starts from now on)."""
    return _current.set(facts)


def unbind(token: Token[RequestFacts | None]) -> None:
    _current.reset(token)


def current() -> RequestFacts | None:
    """The request being served here, if any."""
    return _current.get()


def current_request_id() -> str | None:
    facts = _current.get()
    return facts.request_id if facts is not None else None


def record_generation(generation: Generation) -> None:
    """Add a generation the engine ran to the current request's facts (no-op outside a request)."""
    facts = _current.get()
    if facts is not None:
        facts.generations.append(generation)


def note(**values: Any) -> None:
    """Set facts of the current request (no-op outside a request), e.g. ``note(model="tiny")``."""
    facts = _current.get()
    if facts is not None:
        for name, value in values.items():
            if not hasattr(facts, name):
                raise AttributeError(f"RequestFacts has no field {name!r}")
            setattr(facts, name, value)
