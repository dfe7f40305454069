"""The OpenAPI 3.1 document of the running application, built from its route table.

The route table (`server/app.py`) is the source of truth for paths and methods: `build` walks it
(Mounts included) and reads, for every route, the operations it was declared with
(`server/apidoc.py`), the access rule `protocol_routes` gave it (`server/guard.py`: a route that needs
the API key carries the bearer security requirement) and its protocol's error answers
(`ErrorRenderer.documented`). Request and response schemas are pydantic's JSON schemas of the
declared models, generated in one pass so every model lands once under ``#/components/schemas``.

`routes()` serves the document at ``GET /openapi.json`` and Swagger UI at ``GET /docs``, from files
shipped in ``lmiserve/server/static/`` (no external URL: the page works offline).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from lmiserve import __version__
from lmiserve.server.apidoc import (
    ATTRIBUTE,
    HIDDEN,
    JSON,
    STRING,
    Events,
    Operation,
    Param,
    Reply,
    document,
    hidden,
    ok,
)
from lmiserve.server.guard import Access
from lmiserve.server.responses import raw_response

REF = "#/components/schemas/{model}"
VERSION = "3.1.0"
SECURITY_SCHEME = "apiKey"
HEADER_KEY_SCHEME = "headerKey"  # the key in a protocol's own header (ErrorRenderer.key_header: x-api-key)
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")
TAGS = {  # the order of the groups in the document (and on /docs)
    "LMI": "DJL Serving LMI: /invocations (every body), /predictions, /models/{m}/invoke, /ping",
    "TGI": "Hugging Face text-generation-inference's API",
    "OpenAI": "OpenAI-compatible chat and text completions",
    "TEI": "Hugging Face text-embeddings-inference's /embed and /rerank",
    "Anthropic": "Anthropic's Messages API (the key as `x-api-key` or `Authorization: Bearer`)",
    "KServe V2": "KServe V2 / Open Inference Protocol, with Triton's binary and generate extensions",
    "TF Serving": "TensorFlow Serving's REST API",
    "SageMaker": "Amazon SageMaker's container contract (its records go to /invocations)",
    "Vertex AI": "Vertex AI's custom container contract",
    "LMI management": "Register, describe and unregister models (enable_management_api)",
    "Documentation": "This document and its viewer",
}
_METHODS = ("GET", "PUT", "POST", "DELETE", "OPTIONS", "HEAD", "PATCH", "TRACE")


class UndocumentedRoute(Exception):
    """A route registered without operations (nor `hidden`): every route must say what it does."""


def walk(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, Route]]:
    """(full path pattern, route) of every route, Mounts expanded, in table order."""
    for route in routes:
        if isinstance(route, Mount):
            yield from walk(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            yield prefix + route.path, route


def template(path: str) -> str:
    """A starlette path pattern as an OpenAPI path template: ``{name:path}`` -> ``{name}``."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", path)


def operations(path: str, route: Route, *, strict: bool = True) -> list[tuple[str, str, Operation]]:
    """(method, path template, operation) of every operation `route` declares. A route that declares
    none raises `UndocumentedRoute` when `strict` (the tests), else is listed bare (the served
    document: a route added without its declaration must not break it)."""
    declared = getattr(route, ATTRIBUTE, None)
    if declared is HIDDEN:
        return []
    methods = sorted((route.methods or set()) - {"HEAD"})
    if not declared:
        if strict:
            raise UndocumentedRoute(f"{methods} {path} declares no operation (server/apidoc.py)")
        bare = Operation("Not documented yet", "Undocumented", {200: Reply("Success")})
        return [(method, template(path), bare) for method in methods]
    out = []
    for op in declared:
        if op.method is None and len(methods) != 1:
            raise UndocumentedRoute(f"{path}: an operation of a route with methods {methods} must name its method")
        method = op.method or methods[0]
        if method not in methods:
            raise UndocumentedRoute(f"{path}: {method} is not a method of the route ({methods})")
        out.append((method, template(op.path or path), op))
    return out


class _Schemas:
    """Every schema of the document, generated together (`GenerateJsonSchema.generate_definitions`
    names each model once, and tells apart models that share a class name)."""

    def __init__(self) -> None:
        self.adapters: dict[tuple[int, JsonSchemaMode], Any] = {}
        self.kept: list[Any] = []  # the schemas, so no id() is reused while the document is built

    def add(self, schema: Any, mode: JsonSchemaMode) -> dict[str, Any]:
        """A placeholder for `schema` (a model, a type expression, or a JSON schema dict as is)."""
        if isinstance(schema, dict):
            return dict(schema)
        if isinstance(schema, Events):
            items = [self.add(item, mode) for item in schema.items]
            one_of = items[0] if len(items) == 1 else {"anyOf": items}
            if not schema.sse:
                return {"type": "string", "description": schema.description, "x-events": one_of}
            data: dict[str, Any] = {"type": "string", "contentMediaType": JSON, "contentSchema": one_of}
            if schema.done:
                data = {"anyOf": [{"const": "[DONE]"}, data]}
            return {
                "type": "object",
                "description": schema.description + " (the schema of one event)",
                "properties": {"data": data, "event": dict(STRING), "id": dict(STRING)},
            }
        key = (id(schema), mode)
        if key not in self.adapters:
            self.adapters[key] = TypeAdapter(schema).core_schema
            self.kept.append(schema)
        return {"$pending": key}

    def resolve(self, doc: dict[str, Any]) -> dict[str, Any]:
        inputs = [(key, key[1], core) for key, core in self.adapters.items()]
        mapping, definitions = GenerateJsonSchema(ref_template=REF).generate_definitions(inputs)

        def fill(node: Any) -> Any:
            if isinstance(node, dict):
                if "$pending" in node:
                    key = tuple(node["$pending"])
                    return mapping[(key, key[1])]
                return {k: fill(v) for k, v in node.items()}
            if isinstance(node, list):
                return [fill(v) for v in node]
            return node

        out = fill(doc)
        out.setdefault("components", {})["schemas"] = dict(sorted(definitions.items()))
        return out


def _content(schemas: _Schemas, content: dict[str, Any] | Any, mode: JsonSchemaMode) -> dict[str, Any]:
    return {media: {"schema": schemas.add(schema, mode)} for media, schema in content.items()}


def _responses(schemas: _Schemas, op: Operation, renderers: list[Any]) -> dict[str, Any]:
    replies: dict[int, list[Reply]] = {}
    for status, reply in op.replies.items():
        replies.setdefault(status, []).append(reply)
    for renderer in renderers:
        for status, reply in renderer.documented().items():
            replies.setdefault(status, []).append(reply)
    out: dict[str, Any] = {}
    for status in sorted(replies):
        answers = replies[status]
        media: dict[str, list[Any]] = {}
        for reply in answers:
            for media_type, schema in reply.content.items():
                media.setdefault(media_type, [])
                if not any(schema is known for known in media[media_type]):
                    media[media_type].append(schema)
        entry: dict[str, Any] = {"description": " / ".join(dict.fromkeys(r.description for r in answers))}
        if media:
            entry["content"] = {
                media_type: {
                    "schema": schemas.add(found[0], "serialization")
                    if len(found) == 1
                    else {"anyOf": [schemas.add(s, "serialization") for s in found]}
                }
                for media_type, found in media.items()
            }
        headers = {name: text for reply in answers for name, text in reply.headers.items()}
        if headers:
            entry["headers"] = {name: {"description": text, "schema": dict(STRING)} for name, text in headers.items()}
        out[str(status)] = entry
    return out


def _parameter(param: Param) -> dict[str, Any]:
    return {
        "name": param.name,
        "in": param.location,
        "description": param.description,
        "required": param.required,
        "schema": dict(param.schema),
    }


# A path parameter is one segment; no newline either (a `{x:path}` pattern does not match one, so such a
# path would be nobody's: the application's 404).
_SEGMENT = {"type": "string", "pattern": "^[^/\n]+$"}


def _path_parameters(path: str) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": dict(_SEGMENT)} for name in _PARAM.findall(path)]


def build(routes: list[BaseRoute], *, strict: bool = True) -> dict[str, Any]:
    """The OpenAPI document of `routes` (the application's route table); `strict`: see `operations`."""
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    ids: set[str] = set()
    for pattern, route in walk(routes):
        endpoint = route.endpoint
        for method, path, op in operations(pattern, route, strict=strict):
            item = paths.setdefault(path, {})
            if method.lower() in item:
                continue  # an earlier route answers this method and path (the first match wins)
            renderers = [r for r in (getattr(endpoint, "renderer", None), *op.errors) if r is not None]
            entry: dict[str, Any] = {
                "tags": [op.tag],
                "summary": op.summary,
                "operationId": _operation_id(method, path, ids),
                "parameters": _path_parameters(path) + [_parameter(p) for p in op.params],
                "responses": _responses(schemas, op, renderers),
            }
            if op.description:
                entry["description"] = op.description
            if op.body is not None:
                entry["requestBody"] = {
                    "required": op.body_required,
                    "content": _content(schemas, op.body, "validation"),
                }
            if getattr(endpoint, "access", None) is Access.KEY:
                entry["security"] = [{SECURITY_SCHEME: []}]
                if getattr(getattr(endpoint, "renderer", None), "key_header", None) == "x-api-key":
                    entry["security"].append({HEADER_KEY_SCHEME: []})
            item[method.lower()] = entry
    doc: dict[str, Any] = {
        "openapi": VERSION,
        "info": {
            "title": "lmiserve",
            "version": __version__,
            "description": (
                "One continuously batched engine behind the LMI (/invocations), TGI, OpenAI, KServe V2, "
                "TF Serving, SageMaker and Vertex AI protocols. With an API key configured, every "
                "operation but the health probes and this document needs `Authorization: Bearer <key>`."
            ),
        },
        "tags": [{"name": name, "description": text} for name, text in TAGS.items()],
        "paths": {path: _ordered(item) for path, item in paths.items()},
        "components": {
            "securitySchemes": {
                SECURITY_SCHEME: {"type": "http", "scheme": "bearer", "description": "api_key"},
                HEADER_KEY_SCHEME: {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "api_key"},
            }
        },
    }
    return schemas.resolve(doc)


def _ordered(item: dict[str, Any]) -> dict[str, Any]:
    return {m.lower(): item[m.lower()] for m in _METHODS if m.lower() in item}


def _operation_id(method: str, path: str, taken: set[str]) -> str:
    base = method.lower() + "_" + (re.sub(r"[^0-9A-Za-z]+", "_", path).strip("_") or "root")
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


# --- the routes: /openapi.json, /docs and its assets -------------------------------------------------

ASSETS = {  # file name -> content type; served under /docs/
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "docs.js": "text/javascript; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
CACHE = {"cache-control": "public, max-age=3600"}


def document_of(request: Request) -> bytes:
    """The application's document, built on first use."""
    state = request.app.state
    cached = getattr(state, "openapi_document", None)
    if cached is None:
        cached = json.dumps(build(request.app.routes, strict=False), ensure_ascii=False).encode()
        state.openapi_document = cached
    return cached


async def openapi_json(request: Request) -> Response:
    return raw_response(document_of(request))


async def docs(request: Request) -> Response:
    return raw_response(
        resources.files("lmiserve.server").joinpath("static", "docs.html").read_bytes(), 200, "text/html; charset=utf-8"
    )


def _asset(name: str):
    async def serve(request: Request) -> Response:
        return raw_response(
            resources.files("lmiserve.server").joinpath("static", name).read_bytes(), 200, ASSETS[name], CACHE
        )

    serve.__name__ = "asset_" + re.sub(r"\W", "_", name)
    return serve


def routes() -> list[BaseRoute]:
    """The document and its viewer: public (they do no work and show only the static API)."""
    return [
        document(
            Route("/openapi.json", openapi_json, methods=["GET"]),
            Operation(
                "This API document (OpenAPI 3.1)", "Documentation", ok("The document", {JSON: {"type": "object"}})
            ),
        ),
        document(
            Route("/docs", docs, methods=["GET"]),
            Operation("Swagger UI for this document", "Documentation", ok("An HTML page", {"text/html": STRING})),
        ),
        *(hidden(Route("/docs/" + name, _asset(name), methods=["GET"])) for name in ASSETS),
    ]
