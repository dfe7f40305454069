"""GET /openapi.json and GET /docs on a real server: the document is valid OpenAPI 3.1, it is the one
built from the route table, every route is in it (and nothing else), and the docs page loads only
files the server itself ships (it works offline, with no key)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.routing import Match

from helpers.server import run_server
from lmiserve.config import Settings
from lmiserve.server.apidoc import ATTRIBUTE, HIDDEN
from lmiserve.server.app import routes
from lmiserve.server.openapi import ASSETS, UndocumentedRoute, build, template, walk

KEY = "openapi-key"
VERTEX_PREDICT, VERTEX_HEALTH = "/vertex/predict", "/vertex/health"


def settings(**options) -> Settings:
    return Settings(vertex_predict_route=VERTEX_PREDICT, vertex_health_route=VERTEX_HEALTH, **options)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[httpx.Client]:
    env = {"AIP_PREDICT_ROUTE": VERTEX_PREDICT, "AIP_HEALTH_ROUTE": VERTEX_HEALTH}
    args = ["--model-id", str(tiny_model_dir), "--api-key", KEY]
    with run_server(args, env=env) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        yield client


def test_the_served_document_is_valid_openapi_3_1_and_built_from_the_route_table(live):
    r = live.get("/openapi.json")  # no key: the document is public
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    validate(doc)  # raises on an invalid document
    assert doc == build(routes(settings()))


def test_every_route_is_documented_and_every_operation_is_a_route():
    table = routes(settings())
    doc = build(table)
    documented = {(m.upper(), path) for path, item in doc["paths"].items() for m in item}
    for pattern, route in walk(table):
        declared = getattr(route, ATTRIBUTE, None)
        assert declared, f"{pattern} declares no operation (nor apidoc.hidden)"
        if declared is HIDDEN:
            continue
        for op in declared:
            path = template(op.path or pattern)
            method = op.method or next(iter((route.methods or set()) - {"HEAD"}))
            assert (method, path) in documented, (method, path)
            # the operation's path is one the route matches, with any value in its parameters
            concrete = re.sub(r"\{\w+\}", "x1", path)
            scope = {"type": "http", "path": concrete, "method": method, "root_path": ""}
            assert _answering(table, scope) is route.endpoint, (method, path)


def _answering(table, scope):
    """The endpoint the application would call for `scope` (Mounts included), or None."""
    for route in table:
        match, child = route.matches(scope)
        if match is Match.FULL:
            if hasattr(route, "routes"):  # a Mount: look inside with the rest of the path
                inner = {**scope, **child}
                rest = inner["path"][len(inner.get("root_path", "")) :] if "root_path" in child else inner["path"]
                return _answering(route.routes, {**inner, "path": rest, "root_path": ""})
            return route.endpoint
    return None


def test_an_undeclared_route_fails_the_build():
    from starlette.responses import Response
    from starlette.routing import Route

    async def endpoint(request):
        return Response()

    table = [*routes(settings()), Route("/new", endpoint, methods=["GET"])]
    with pytest.raises(UndocumentedRoute):
        build(table)
    # the served document lists it bare rather than failing
    assert build(table, strict=False)["paths"]["/new"]["get"]["tags"] == ["Undocumented"]


def test_key_routes_carry_the_security_requirement_and_probes_do_not():
    doc = build(routes(settings()))
    assert doc["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "api_key",
    }
    assert doc["paths"]["/generate"]["post"]["security"] == [{"apiKey": []}]
    for path in ("/ping", "/health", "/v2/health/ready", "/openapi.json", "/docs"):
        assert "security" not in doc["paths"][path]["get"], path


def test_error_answers_are_in_each_protocols_shape():
    doc = build(routes(settings()))
    schemas = doc["components"]["schemas"]

    def ref(path, method, status, media="application/json"):
        return doc["paths"][path][method]["responses"][status]["content"][media]["schema"]

    assert ref("/generate", "post", "422") == {"$ref": "#/components/schemas/TgiError"}
    assert ref("/v2/models/{model}/infer", "post", "400") == {"$ref": "#/components/schemas/TensorError"}
    assert ref("/models", "get", "400") == {"$ref": "#/components/schemas/FrontendError"}
    assert ref("/invocations", "post", "424")["anyOf"][0] == {"$ref": "#/components/schemas/CompactError"}
    assert set(schemas["TgiError"]["required"]) == {"error", "error_type"}
    # TGI's body rejections are plain text
    assert doc["paths"]["/generate"]["post"]["responses"]["415"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }


def test_streams_are_documented_as_event_streams():
    doc = build(routes(settings()))
    content = doc["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert list(content) == ["text/event-stream"]
    # OpenAPI 3.1's event stream: the schema of one event, whose `data` is JSON of the event models
    data = content["text/event-stream"]["schema"]["properties"]["data"]
    assert data["contentMediaType"] == "application/json"
    events = data["contentSchema"]["anyOf"]
    assert {"$ref": "#/components/schemas/StreamResponse"} in events
    invocations = doc["paths"]["/invocations"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "application/jsonlines", "text/event-stream", "text/csv"} <= set(invocations)


def test_the_docs_page_loads_only_files_the_server_ships(live):
    page = live.get("/docs")  # no key
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "//" not in html  # no URL of another host, not even a scheme-relative one
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert set(urls) == {f"/docs/{name}" for name in ASSETS if name != "docs.js"} | {"/docs/docs.js"}
    for name, content_type in ASSETS.items():
        r = live.get(f"/docs/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"] == content_type, name
        assert len(r.content) > 0
    init = live.get("/docs/docs.js").text
    assert 'url: "/openapi.json"' in init and "validatorUrl: null" in init
    assert "http://" not in init and "https://" not in init


def test_an_unknown_docs_file_is_404(live):
    r = live.get("/docs/../openapi.json")
    assert r.status_code in (200, 404)  # a client may normalise the dots; the server never reads outside
    r = live.get("/docs/nothing.js")
    assert r.status_code == 404
    assert r.json()["type"] == "ResourceNotFoundException"


def test_the_swagger_ui_license_ships_with_it():
    from importlib import resources

    static = resources.files("lmiserve.server").joinpath("static")
    assert "Apache License" in static.joinpath("LICENSE").read_text()
    assert "swagger-ui-dist 5.35.0" in static.joinpath("README.md").read_text().replace("`", "")
