"""The request-log pieces in process: the middleware around the app (an unforeseen 500 is echoed and
logged too, `request_id_header_key`), the per-request facts (tokens counted once per input) and the
log formats. The behaviour on a real server is in tests/integration/test_request_logs.py."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from lmiserve.config import Settings
from lmiserve.core.events import Finish, FinishReason, StepEvent, Token
from lmiserve.core.request import GenerationRequest
from lmiserve.core.request_context import RequestFacts, current_request_id
from lmiserve.server.app import LmiServeApp, _unexpected
from lmiserve.server.log_setup import TEXT_FORMAT, JsonFormatter, RequestIdFilter


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


async def boom(request: Request) -> Response:
    raise RuntimeError("unforeseen")


async def who(request: Request) -> Response:
    return PlainTextResponse(f"{current_request_id()} {GenerationRequest('x').request_id}")


def app(**options: str) -> LmiServeApp:
    application = LmiServeApp(
        routes=[Route("/boom", boom), Route("/who", who)], exception_handlers={Exception: _unexpected}
    )
    application.state.settings = Settings.from_options(options)
    return application


def client(application: LmiServeApp) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_an_unforeseen_500_is_echoed_and_logged(records):
    async with client(app()) as c:
        r = await c.get("/boom", headers={"X-Request-Id": "r-500"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "r-500"
    failure = next(rec for rec in records.records if rec.name == "lmiserve.server.app")
    assert failure.request_id == "r-500" and failure.exc_info is not None  # type: ignore[attr-defined]
    (access,) = [rec for rec in records.records if rec.name == "lmiserve.access"]
    assert access.access["status"] == 500 and access.request_id == "r-500"  # type: ignore[attr-defined]


async def test_the_id_is_the_requests_and_its_generation_requests():
    async with client(app()) as c:
        r = await c.get("/who", headers={"X-Request-Id": "r-1"})
    assert r.text == "r-1 r-1"
    assert GenerationRequest("x").request_id.startswith("req-")  # outside a request: a counter


async def test_request_id_header_key_is_read_first_and_echoed():
    async with client(app(request_id_header_key="X-Correlation-Id")) as c:
        r = await c.get("/who", headers={"X-Correlation-Id": "c-1", "X-Request-Id": "r-1"})
        made = await c.get("/who")
    assert r.headers["x-correlation-id"] == r.headers["x-request-id"] == r.headers["requestid"] == "c-1"
    assert made.headers["x-correlation-id"] == made.headers["x-request-id"] and "requestid" not in made.headers


def finish(prompt: int, generated: int, reason: FinishReason = FinishReason.LENGTH) -> Finish:
    return Finish(reason, "", generated, "", prompt)


def test_facts_count_each_inputs_prompt_once():
    facts = RequestFacts("r")
    token = Token(1, "a", None)
    facts.observe(0, StepEvent(token))
    assert facts.first_token is not None
    facts.observe(0, StepEvent(token, finish=finish(5, 2), index=0))
    facts.observe(0, StepEvent(token, finish=finish(5, 3, FinishReason.EOS_TOKEN), index=1))  # n=2: same prompt
    facts.observe(1, StepEvent(None, finish=finish(7, 1)))  # a second input
    fields = facts.fields()
    assert (fields["prompt_tokens"], fields["generated_tokens"]) == (12, 6)
    assert fields["finish_reason"] == "length,eos_token"
    facts.disconnected = True
    assert facts.fields()["finish_reason"] == "cancelled"


def test_json_lines_are_one_object_each():
    formatter = JsonFormatter()
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("two\nlines",), sys.exc_info())
    RequestIdFilter().filter(record)
    line = formatter.format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["message"] == "failed: two\nlines" and "ValueError: bad" in doc["exc_info"]
    assert "request_id" not in doc and doc["level"] == "ERROR" and doc["logger"] == "x"


def test_text_lines_tag_the_request_id():
    formatter = logging.Formatter(TEXT_FORMAT)
    record = logging.LogRecord("lmiserve.x", logging.INFO, __file__, 1, "hello", (), None)
    record.request_id = "abc"
    RequestIdFilter().filter(record)
    assert formatter.format(record).endswith(" INFO lmiserve.x [abc]: hello")
    plain = logging.LogRecord("lmiserve.x", logging.INFO, __file__, 1, "hello", (), None)
    RequestIdFilter().filter(plain)
    assert formatter.format(plain).endswith(" INFO lmiserve.x: hello")


# ---- probes: their access lines are DEBUG lines ----------------------------------------------------------


async def ok(request: Request) -> Response:
    return PlainTextResponse("ok")


def probe_app() -> LmiServeApp:
    """The probes' routes as the protocols register them (`rendered_by` notes the route and protocol)."""
    from lmiserve.protocols.lmi.errors import RENDERER as LMI
    from lmiserve.protocols.tensor.kserve.errors import RENDERER as KSERVE
    from lmiserve.protocols.tensor.vertex.errors import RENDERER as VERTEX
    from lmiserve.protocols.tgi.errors import RENDERER as TGI
    from lmiserve.server.errors import rendered_by

    def route(path: str, renderer, methods: list[str]) -> Route:
        return Route(path, rendered_by(renderer, ok, route=path), methods=methods)

    application = LmiServeApp(
        routes=[
            route("/ping", LMI, ["GET", "POST"]),
            route("/health", TGI, ["GET"]),
            route("/", TGI, ["GET", "POST"]),
            route("/generate", TGI, ["POST"]),
            route("/v2/health/ready", KSERVE, ["GET"]),
            route("/v2/models/{model}/ready", KSERVE, ["GET"]),
            route("/v2/models/{model}/infer", KSERVE, ["POST"]),
            route("/custom/health", VERTEX, ["GET"]),  # a vertex_health_route
            route("/custom/predict", VERTEX, ["POST"]),
        ]
    )
    application.state.settings = Settings.from_options({})
    return application


async def test_probes_are_logged_at_debug_level_and_other_requests_at_info(records):
    logging.getLogger().setLevel(logging.DEBUG)
    async with client(probe_app()) as c:
        for path in ("/ping", "/health", "/", "/v2/health/ready", "/v2/models/m/ready", "/custom/health"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.post("/ping")).status_code == 200
        for path in ("/generate", "/", "/v2/models/m/infer", "/custom/predict"):
            assert (await c.post(path)).status_code == 200, path
        assert (await c.get("/no/such/route")).status_code == 404
    levels = [
        (r.access["method"], r.access["path"], r.levelname) for r in records.records if r.name == "lmiserve.access"
    ]  # type: ignore[attr-defined]
    assert levels == [
        ("GET", "/ping", "DEBUG"),
        ("GET", "/health", "DEBUG"),
        ("GET", "/", "DEBUG"),
        ("GET", "/v2/health/ready", "DEBUG"),
        ("GET", "/v2/models/m/ready", "DEBUG"),
        ("GET", "/custom/health", "DEBUG"),
        ("POST", "/ping", "DEBUG"),
        ("POST", "/generate", "INFO"),
        ("POST", "/", "INFO"),  # TGI's generate, not its health
        ("POST", "/v2/models/m/infer", "INFO"),
        ("POST", "/custom/predict", "INFO"),
        ("GET", "/no/such/route", "INFO"),
    ]


async def test_at_info_level_a_probe_leaves_no_access_line(records):
    async with client(probe_app()) as c:
        await c.get("/ping")
        await c.post("/generate")
    assert [r.access["path"] for r in records.records if r.name == "lmiserve.access"] == ["/generate"]  # type: ignore[attr-defined]
