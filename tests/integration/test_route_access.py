"""Every route of the app is registered with an access rule (`lmiserve.server.guard`), and a real server
enforces it and `max_request_size` on every route, in that route's protocol shape.

The audit walks the route table `create_app` builds (Mounts included): a route whose endpoint was not
registered through `protocol_routes` fails the test, and the open routes must be exactly `OPEN` below
(health and readiness probes, OPTIONS on the inference routes, which answers ``{}``, the playground's
static page and files, and the static API document with its viewer). A route added later is guarded by
default and covered here without editing this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from helpers.route_table import VERTEX_ENV, VERTEX_HEALTH, Entry, concrete, entries, expected, route_table, settings
from helpers.server import run_server
from lmiserve.core.errors import PayloadTooLarge, Unauthorized
from lmiserve.server.guard import Access, too_large

KEY = "route-audit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 4096  # max_request_size of the live server

# (method, path) of every route that never asks for the key.
OPEN = {
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/"),
    ("GET", "/health"),
    ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2/models/{model}/ready"),
    ("GET", "/v2/models/{model}/versions/{version}/ready"),
    ("GET", VERTEX_HEALTH),
    ("GET", "/v1/endpoints/{endpoint}/deployedModels/{deployed}"),
    ("OPTIONS", "/invocations"),
    ("OPTIONS", "/predictions/{model_name}"),
    ("OPTIONS", "/predictions/{model_name}/{version}"),
    ("OPTIONS", "/models/{model_name}/invoke"),
    # the playground's page and files: static, no work, nothing about the server (its stats stream needs the key)
    ("GET", "/playground"),
    ("GET", "/playground/playground.js"),
    ("GET", "/playground/playground.css"),
    # the API document and its viewer: static, no work done
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/docs/swagger-ui-bundle.js"),
    ("GET", "/docs/swagger-ui.css"),
    ("GET", "/docs/docs.js"),
    ("GET", "/docs/favicon-32x32.png"),
}


def test_every_route_has_an_access_rule():
    unguarded = [(e.method, e.path) for e in route_table(settings()) if e.access is None]
    assert unguarded == [], "routes registered outside protocol_routes (no API key, no body limit)"


def test_the_open_routes_are_exactly_the_probes():
    open_routes = {(e.method, e.path) for e in route_table(settings()) if e.access in (Access.OPEN, Access.LIVE)}
    assert open_routes == OPEN


def test_the_liveness_probe_is_the_only_route_that_answers_during_the_drain():
    live = {(e.method, e.path) for e in route_table(settings()) if e.access is Access.LIVE}
    assert live == {("GET", "/v2/health/live")}


def test_management_api_can_be_turned_off():
    def management(table):
        return {(e.method, e.path) for e in table if e.path.startswith("/models") and not e.path.endswith("/invoke")}

    assert ("DELETE", "/models/{model_name}") in management(route_table(settings()))
    assert management(route_table(settings(enable_management_api=False))) == set()


# --- a real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir) -> Iterator[tuple[httpx.Client, str]]:
    args = ["--model-id", str(tiny_model_dir), "--api-key", KEY]
    for option in (f"max_request_size={LIMIT}", "max_new_tokens=2"):
        args += ["-o", option]
    with run_server(args, env=VERTEX_ENV) as url, httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        name = client.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
        yield client, name


def guarded_entries() -> list[Entry]:
    return entries({Access.KEY})


@pytest.mark.parametrize("entry", guarded_entries(), ids=lambda e: f"{e.method} {e.path}")
def test_guarded_routes_need_the_key(live, entry):
    client, model = live
    path = concrete(entry.path, model, entry.method)
    status, body = expected(entry, Unauthorized("missing or wrong API key"))
    # the key in its own header only where the protocol's clients send it so (Anthropic's x-api-key)
    key_header = entry.endpoint.endpoint.renderer.key_header  # type: ignore[attr-defined]
    refused = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": "wrong"}]
    accepted = [AUTH] if key_header is None else [AUTH, {key_header: KEY}]
    if key_header is None:
        refused.append({"X-Api-Key": KEY})
    for headers in refused:
        r = client.request(entry.method, path, json={"inputs": "hi"}, headers=headers)
        assert (r.status_code, r.content) == (status, body), (path, headers)
    for headers in accepted:
        r = client.request(entry.method, path, json={"inputs": "hi"}, headers=headers)
        assert r.status_code != 401, (path, headers)


@pytest.mark.parametrize("method,path", sorted(OPEN))
def test_open_routes_answer_without_the_key(live, method, path):
    client, model = live
    r = client.request(method, concrete(path, model, method))
    assert r.status_code == 200, (method, path, r.text)


@pytest.mark.parametrize("entry", guarded_entries(), ids=lambda e: f"{e.method} {e.path}")
def test_bodies_above_max_request_size_are_413_in_the_protocols_shape(live, entry):
    client, model = live
    path = concrete(entry.path, model, entry.method)
    status, body = expected(entry, too_large(LIMIT))
    assert status == 413 and isinstance(too_large(LIMIT), PayloadTooLarge), (status, body)
    big = b'{"inputs": "' + b"x" * LIMIT + b'"}'
    declared = client.request(entry.method, path, content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert (declared.status_code, declared.content) == (status, body), path

    if entry.method not in ("POST", "PUT"):
        return  # the other methods' handlers never read a body, so a chunked one is never buffered

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield big[: LIMIT // 2]
        yield big[LIMIT // 2 :]

    if entry.path.endswith("{path:path}") or entry.path == "/v1/models" or entry.method == "PUT":
        return  # answered (404/400) from the path alone, before any body is read

    streamed = client.request(
        entry.method, path, content=chunks(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert (streamed.status_code, streamed.content) == (status, body), path


def test_a_body_at_the_limit_is_read(live):
    client, _ = live
    payload = b'{"inputs": "hello", "parameters": {"max_new_tokens": 2}}'
    body = payload + b" " * (LIMIT - len(payload))
    r = client.post("/invocations", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_open_routes_limit_bodies_too(live):
    client, _ = live
    r = client.post("/ping", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413


def test_oversized_request_headers_are_refused_and_the_server_lives_on(live):
    client, _ = live
    r = client.get("/ping", headers={"X-Filler": "a" * 70_000})  # above max_header_size (64 KiB)
    assert r.status_code == 431
    r = client.post("/generate", json={"inputs": "hi"}, headers={**AUTH, "X-Filler": "a" * 70_000})
    assert (r.status_code, r.text) == (431, "Request headers are larger than max_header_size (65536 bytes)")
    # far above: uvicorn stops buffering the head and answers 400, or closes before the client is done
    with contextlib.suppress(httpx.TransportError):
        assert client.get("/ping", headers={"X-Filler": "a" * 1_000_000}).status_code == 400
    assert client.get("/ping").status_code == 200


def test_registration_needs_a_model_root(live, tmp_path):
    client, _ = live
    r = client.post("/models", params={"url": str(tmp_path)}, headers=AUTH)
    assert (r.status_code, r.json()["type"]) == (403, "ForbiddenException")
    assert "no model root is configured" in r.json()["message"]
