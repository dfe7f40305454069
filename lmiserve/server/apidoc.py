"""What a route tells the API document (`lmiserve.server.openapi`) about itself, declared next to it.

A protocol wraps a route with `document(Route(...), Operation(...), ...)` before registering it with
`protocol_routes`; the generator reads the route table and finds each operation there. An operation
names its summary, its request body and its success answers as pydantic models (or type expressions
such as ``list[Model]``, or a raw JSON schema dict); the route group's `ErrorRenderer` adds the error
answers of its protocol (`ErrorRenderer.documented`). A route answered in several ways by path (TF
Serving's ``/v1/models/{rest:path}``) lists an operation per concrete path; a route with nothing to
document (a catch-all 404) is `hidden`.

The declarations are data only: they never change what a route does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import BaseRoute

ATTRIBUTE = "openapi"  # where a route keeps its operations (a tuple), or HIDDEN

JSON = "application/json"
SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
TEXT = "text/plain"

STRING: dict[str, Any] = {"type": "string"}  # the schema of a text body (SSE, JSON Lines, plain text)


@dataclass(frozen=True)
class Reply:
    """One answer: a description and its body by media type (no body: an empty `content`)."""

    description: str
    content: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # header name -> description


@dataclass(frozen=True)
class Param:
    """A query parameter (path parameters come from the route's path)."""

    name: str
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: dict(STRING))
    required: bool = False
    location: str = "query"


@dataclass(frozen=True)
class Operation:
    """One method on one path. `method` may be omitted on a route with a single method; `path`
    replaces the route's path (it must be a path the route matches)."""

    summary: str
    tag: str
    replies: Mapping[int, Reply]
    body: Mapping[str, Any] | None = None  # media type -> schema of the request body
    body_required: bool = True
    params: Sequence[Param] = ()
    description: str = ""
    method: str | None = None
    path: str | None = None
    errors: Sequence[Any] = ()  # more ErrorRenderers whose answers this operation may give


@dataclass(frozen=True)
class Events:
    """A streamed body whose every event or line holds one of `items` (JSON). As server-sent events
    (`sse`), the schema is OpenAPI 3.1's for an event stream: each event's ``data`` is a JSON text of
    `items` (``contentMediaType``/``contentSchema``), or ``[DONE]`` where the stream ends with it;
    otherwise (JSON Lines) the body is text and the lines' schema its ``x-events``."""

    items: tuple[Any, ...]
    description: str
    sse: bool = False
    done: bool = False  # the last event is `data: [DONE]` (OpenAI)

    def __init__(self, description: str, *items: Any, sse: bool = False, done: bool = False):
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "sse", sse)
        object.__setattr__(self, "done", done)


def sse(description: str, *items: Any, done: bool = False) -> dict[str, Events]:
    """A text/event-stream body of `items` events."""
    return {SSE: Events(description, *items, sse=True, done=done)}


class Hidden:
    """A route the document leaves out (an answer for unknown paths, not an API)."""


HIDDEN = Hidden()


def document(route: BaseRoute, *operations: Operation) -> BaseRoute:
    """`route`, carrying `operations` for the API document."""
    setattr(route, ATTRIBUTE, tuple(operations))
    return route


def hidden(route: BaseRoute) -> BaseRoute:
    setattr(route, ATTRIBUTE, HIDDEN)
    return route


def ok(
    description: str, content: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None
) -> dict[int, Reply]:
    """``{200: Reply(...)}``; `content` maps media types to schemas."""
    return {200: Reply(description, content or {}, headers or {})}


def json(schema: Any) -> dict[str, Any]:
    """A JSON body of `schema`."""
    return {JSON: schema}
