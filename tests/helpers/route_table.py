"""The app's route table as (method, path pattern, access, route) entries, for audits that walk every
route (tests/integration/test_route_access.py, test_drain.py), and what a route's renderer answers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.requests import Request
from starlette.routing import Mount, Route

from lmiserve.config import Settings
from lmiserve.core.errors import LmiServeError
from lmiserve.models.service import ModelService
from lmiserve.server.app import create_app
from lmiserve.server.guard import Access

VERTEX_PREDICT, VERTEX_HEALTH = "/vertex/predict", "/vertex/health"
VERTEX_ENV = {"AIP_PREDICT_ROUTE": VERTEX_PREDICT, "AIP_HEALTH_ROUTE": VERTEX_HEALTH}


@dataclass(frozen=True)
class Entry:
    method: str
    path: str  # the full path pattern
    access: Access | None
    endpoint: object


def settings(**options) -> Settings:
    return Settings(vertex_predict_route=VERTEX_PREDICT, vertex_health_route=VERTEX_HEALTH, **options)


def route_table(app_settings: Settings) -> list[Entry]:
    app = create_app(app_settings, ModelService(app_settings))
    out: list[Entry] = []

    def walk(routes, prefix: str) -> None:
        for route in routes:
            if isinstance(route, Mount):
                walk(route.routes, prefix + route.path)
            elif isinstance(route, Route):
                for method in sorted((route.methods or set()) - {"HEAD"}):
                    out.append(Entry(method, prefix + route.path, getattr(route.endpoint, "access", None), route))
            else:
                out.append(Entry("?", prefix + getattr(route, "path", "?"), None, route))

    walk(app.routes, "")
    return out


def concrete(path: str, model: str, method: str) -> str:
    """A path of the pattern with the served model's name in it (another name for DELETE, which would
    unregister the model the other tests use)."""
    model = "not-served" if method == "DELETE" else model
    values = {
        "model_name": model,
        "model": model,
        "version": "1",
        "endpoint": "e1",
        "deployed": f"{model}:predict" if method == "POST" else model,
        "rest": f"{model}:predict" if method == "POST" else model,
        "path": "anything",
        "response_id": "resp_not_stored",
        "adapter_name": "not-registered",
    }
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values[m.group(1)], path)


def entries(access: set[Access]) -> list[Entry]:
    """The (method, path) patterns registered with one of `access`, each once: the first route of a
    pattern is the one that answers (OpenAI's exact `GET /v1/models` comes before TF Serving's)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for e in route_table(settings()):
        if e.access in access and (e.method, e.path) not in seen:
            seen.add((e.method, e.path))
            out.append(e)
    return out


def expected(entry: Entry, exc: LmiServeError) -> tuple[int, bytes]:
    """The status and body the route's renderer gives `exc`."""
    app = create_app(settings(), ModelService(settings()))
    scope = {"type": "http", "method": entry.method, "path": "/", "headers": [], "query_string": b"", "app": app}
    response = entry.endpoint.endpoint.renderer.response(exc, Request(scope))  # type: ignore[attr-defined]
    return response.status_code, response.body
