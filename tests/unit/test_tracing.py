"""Tracing in process (lmiserve.server.tracing, lmiserve.server.otlp): what a request's facts become
(the span's attributes and its queue/prefill/decode children, pure functions), the spans as a real OTLP
receiver gets them (tests/helpers/otlp_receiver.py), the access middleware's span and trace id, the
gRPC helper `rpc_span`, a collector that is down, and that tracing off imports nothing of OpenTelemetry.
The real server is in tests/integration/test_tracing_server.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from helpers.otlp_receiver import Receiver, otlp_grpc_receiver
from helpers.server import REPO_ROOT, free_port
from lmiserve.config import Settings
from lmiserve.core import request_context
from lmiserve.core.errors import QueueTimeout
from lmiserve.core.events import FinishReason
from lmiserve.core.request_context import Generation, RequestFacts
from lmiserve.core.stats import RequestStats, SequenceStats
from lmiserve.server import tracing
from lmiserve.server.access import write_access_line
from lmiserve.server.app import LmiServeApp
from lmiserve.server.log_setup import JsonFormatter, RequestIdFilter
from lmiserve.server.tracing import Tracing, http_attributes, phases, rpc_names, server_attributes, trace_headers

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def seq(
    arrival: float = 10.0,
    scheduled: float | None = 10.5,
    first_token: float | None = 11.0,
    finished: float = 12.0,
    generated: int = 4,
    reason: FinishReason = FinishReason.LENGTH,
    cached: int = 0,
    prompt: int = 7,
) -> SequenceStats:
    return SequenceStats(arrival, scheduled, first_token, finished, prompt, generated, 16, reason, cached)


def generation(*seqs: SequenceStats, error: BaseException | None = None, **settings: float) -> Generation:
    stats = RequestStats(seqs[0].arrival, max(s.finished for s in seqs), seqs[0].prompt_tokens, seqs, error)
    return Generation(int(settings.get("max_new_tokens", 16)), settings.get("temperature", 0.0), 0.9, stats)


def facts_of(*generations: Generation, **values) -> RequestFacts:
    facts = RequestFacts("rid-1", method="POST", path="/generate", start=9.5, end=12.5)
    facts.route, facts.protocol, facts.model, facts.status = "/generate", "tgi", "tiny", 200
    facts.generations.extend(generations)
    for name, value in values.items():
        setattr(facts, name, value)
    return facts


# ---- what a request's facts become ------------------------------------------------------------------


def test_a_generation_gives_the_gen_ai_attributes_and_three_phases():
    facts = facts_of(generation(seq(cached=3), temperature=0.7, max_new_tokens=16))
    facts.prompt_tokens, facts.generated_tokens, facts.cached_tokens = 7, 4, 3  # as the pipeline counted
    facts.first_token, facts.finish_reasons = 11.25, ["length"]
    attrs = server_attributes(facts)
    assert attrs == {
        "lmiserve.request_id": "rid-1",
        "lmiserve.protocol": "tgi",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.usage.cache_read.input_tokens": 3,
        "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.response.time_to_first_chunk": 1.75,  # from the request's arrival (9.5) to its first token
        "gen_ai.latency.time_to_first_token": 1.75,
        "gen_ai.latency.time_in_queue": 0.5,
    }
    assert [(p.name, p.start, p.end) for p in phases(facts)] == [
        ("queue", 10.0, 10.5),
        ("prefill", 10.5, 11.0),
        ("decode", 11.0, 12.0),
    ]
    queue, prefill, decode = phases(facts)
    assert queue.attributes == {"lmiserve.sequences": 1}
    assert prefill.attributes == {"gen_ai.usage.input_tokens": 7, "gen_ai.usage.cache_read.input_tokens": 3}
    assert decode.attributes == {"gen_ai.usage.output_tokens": 4}


def test_the_engines_counts_stand_in_where_the_response_pipeline_counted_nothing():
    """A gRPC call need not go through the HTTP pipeline: usage, reasons and the first token come from
    the engine's figures then."""
    facts = facts_of(generation(seq(generated=3, reason=FinishReason.EOS_TOKEN), seq(first_token=10.75, generated=5)))
    attrs = server_attributes(facts)
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (7, 8)
    assert attrs["gen_ai.response.finish_reasons"] == ["eos_token", "length"]
    assert attrs["gen_ai.latency.time_to_first_token"] == 1.25
    assert "gen_ai.usage.cache_read.input_tokens" not in attrs


def test_several_generations_make_one_set_of_phases_from_the_first_admission_to_the_last_end():
    first = generation(seq(arrival=10.0, scheduled=10.2, first_token=10.6, finished=11.0))
    second = generation(seq(arrival=10.1, scheduled=10.4, first_token=10.9, finished=12.0, prompt=5))
    facts = facts_of(first, second)
    assert [(p.name, p.start, p.end) for p in phases(facts)] == [
        ("queue", 10.0, 10.2),
        ("prefill", 10.2, 10.6),
        ("decode", 10.6, 12.0),
    ]
    assert server_attributes(facts)["gen_ai.usage.input_tokens"] == 12  # each input's prompt once


def test_a_request_that_never_left_the_queue_has_only_a_queue_phase():
    timed_out = seq(scheduled=None, first_token=None, finished=11.5, generated=0, reason=FinishReason.ERROR)
    facts = facts_of(generation(timed_out, error=QueueTimeout("Time out in: 1")), status=424)
    (queue,) = phases(facts)
    assert (queue.start, queue.end, queue.attributes["error.type"]) == (10.0, 11.5, "QueueTimeout")
    attrs = server_attributes(facts)
    assert attrs["gen_ai.latency.time_in_queue"] == 1.5 and "gen_ai.latency.time_to_first_token" not in attrs
    ended_in_prefill = facts_of(generation(seq(first_token=None, generated=0, reason=FinishReason.ABORT)))
    assert [p.name for p in phases(ended_in_prefill)] == ["queue", "prefill"]


def test_a_client_that_left_is_a_cancelled_finish_and_a_request_without_generation_has_no_phases():
    facts = facts_of(generation(seq(reason=FinishReason.ABORT)), disconnected=True)
    assert server_attributes(facts)["gen_ai.response.finish_reasons"] == ["cancelled"]
    plain = RequestFacts("r", method="GET", path="/v1/models")
    assert phases(plain) == [] and server_attributes(plain) == {"lmiserve.request_id": "r"}


def test_http_attributes_names_and_trace_headers():
    facts = facts_of()
    headers = [
        (b"user-agent", b"curl/8"),
        (b"traceparent", TRACEPARENT.encode()),
        (b"tracestate", b"k=v"),
        (b"traceparent", b"00-second-one-is-ignored"),
    ]
    scope = {"scheme": "http", "http_version": "1.1", "client": ("10.0.0.1", 5555), "headers": headers}
    assert http_attributes(scope, facts) == {
        "http.request.method": "POST",
        "url.path": "/generate",
        "url.scheme": "http",
        "http.route": "/generate",
        "http.response.status_code": 200,
        "network.protocol.version": "1.1",
        "client.address": "10.0.0.1",
        "user_agent.original": "curl/8",
    }
    assert trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert tracing.http_span_name(facts) == "POST /generate"
    assert tracing.http_span_name(RequestFacts("r", method="GET", path="/nowhere")) == "GET"
    assert rpc_names("/inference.GRPCInferenceService/ModelInfer") == ("inference.GRPCInferenceService", "ModelInfer")
    assert rpc_names("ModelStreamInfer") == (None, "ModelStreamInfer")


def test_exporter_endpoints():
    from lmiserve.server.otlp import exporter_endpoint

    assert exporter_endpoint("http://c:4318", "http/protobuf") == "http://c:4318/v1/traces"
    assert exporter_endpoint("http://c:4318/", "http/protobuf") == "http://c:4318/v1/traces"
    assert exporter_endpoint("c:4318", "http/protobuf") == "http://c:4318/v1/traces"
    assert exporter_endpoint("https://c/otlp/v1/traces", "http/protobuf") == "https://c/otlp/v1/traces"
    assert exporter_endpoint("http://c:4317", "grpc") == "http://c:4317"


def test_the_sdks_complaints_are_throttled():
    from lmiserve.server.otlp import _Throttle

    throttle = _Throttle(interval=3600)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("opentelemetry.x", logging.WARNING, __file__, 1, msg, (), None)

    assert throttle.filter(record("Queue full, dropping %s."))
    assert not throttle.filter(record("Queue full, dropping %s."))
    assert throttle.filter(record("Failed to export %s"))


# ---- spans as a collector receives them ----------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with otlp_grpc_receiver() as received:
        yield received


@pytest.fixture
def started(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracing]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    traced = Tracing(receiver.endpoint, "grpc")
    traced.start()
    assert traced.on and tracing.active() is traced
    try:
        yield traced
    finally:
        traced.stop()
    assert tracing.active() is None


def test_a_span_continues_the_callers_trace_with_its_phases_as_children(started: Tracing, receiver: Receiver):
    facts = facts_of(generation(seq()))
    scope = {"scheme": "http", "headers": [(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"k=v")]}
    started.record_http(scope, facts)
    assert facts.trace_id == TRACE_ID
    span = receiver.wait_for(lambda s: s.kind == "SERVER", "the server span")
    assert (span.name, span.trace_id, span.parent_span_id, span.trace_state) == (
        "POST /generate",
        TRACE_ID,
        PARENT_ID,
        "k=v",
    )
    assert span.attributes["lmiserve.request_id"] == "rid-1" and span.attributes["gen_ai.request.model"] == "tiny"
    assert span.resource["service.name"] == "lmiserve" and span.scope == "lmiserve"
    assert span.status_code == 0
    wait = lambda: len(receiver.children(span)) == 3  # noqa: E731
    receiver.wait_for(lambda s: wait(), "the three phases")
    children = receiver.children(span)
    assert all(c.kind == "INTERNAL" and c.trace_id == TRACE_ID for c in children.values())
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert span.start_ns < queue.start_ns < queue.end_ns == prefill.start_ns < prefill.end_ns == decode.start_ns
    assert decode.end_ns < span.end_ns
    assert round(span.seconds, 6) == 3.0 and round(queue.seconds, 6) == 0.5  # the facts' own times


def test_a_server_error_marks_the_span_failed_and_a_request_without_caller_starts_a_trace(
    started: Tracing, receiver: Receiver
):
    facts = facts_of(status=503)
    started.record_http({"headers": []}, facts)
    span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "rid-1", "the span")
    assert span.status_code == 2 and span.attributes["error.type"] == "503"
    assert span.parent_span_id == "" and span.trace_id == facts.trace_id


async def ok(request: Request) -> Response:
    request_context.note(model="tiny")
    return PlainTextResponse("ok")


async def test_the_middleware_traces_requests_but_not_probes_and_logs_the_trace_id(
    started: Tracing, receiver: Receiver, caplog: pytest.LogCaptureFixture
):
    from lmiserve.protocols.lmi.errors import RENDERER as LMI
    from lmiserve.protocols.tgi.errors import RENDERER as TGI
    from lmiserve.server.errors import rendered_by

    routes = [
        Route("/ping", rendered_by(LMI, ok, route="/ping")),
        Route("/generate", rendered_by(TGI, ok, route="/generate"), methods=["POST"]),
    ]
    application = LmiServeApp(routes=routes)
    application.state.settings = Settings.from_options({})
    application.state.tracing = started
    caplog.set_level(logging.DEBUG, logger="lmiserve.access")
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/ping", headers={"X-Request-Id": "probe-1"})).status_code == 200
        answer = await client.post("/generate", headers={"traceparent": TRACEPARENT, "X-Request-Id": "req-1"})
    assert answer.status_code == 200
    span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "req-1", "the span")
    assert span.trace_id == TRACE_ID and span.name == "POST /generate" and span.attributes["lmiserve.protocol"] == "tgi"
    assert span.attributes["gen_ai.request.model"] == "tiny" and span.attributes["http.route"] == "/generate"
    lines = {r.request_id: r for r in caplog.records if r.name == "lmiserve.access"}  # type: ignore[attr-defined]
    assert lines["req-1"].access["trace_id"] == TRACE_ID  # type: ignore[attr-defined]
    assert f"trace_id={TRACE_ID}" in lines["req-1"].getMessage()
    assert "trace_id" not in lines["probe-1"].access  # type: ignore[attr-defined]
    assert not receiver.find(lambda s: s.attributes.get("lmiserve.request_id") == "probe-1")


def test_the_trace_id_is_a_field_of_json_access_lines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="lmiserve.access")
    facts = facts_of(trace_id=TRACE_ID)
    write_access_line(facts)
    write_access_line(facts_of())
    with_trace, without = (r for r in caplog.records if r.name == "lmiserve.access")
    RequestIdFilter().filter(with_trace)
    doc = __import__("json").loads(JsonFormatter().format(with_trace))
    assert doc["trace_id"] == TRACE_ID and doc["request_id"] == "rid-1"
    assert with_trace.getMessage().endswith(f"finish_reason=- trace_id={TRACE_ID}")
    assert "trace_id" not in without.getMessage()


def test_rpc_span_traces_a_grpc_call_with_the_callers_metadata(started: Tracing, receiver: Receiver):
    metadata = {"traceparent": TRACEPARENT, "x-request-id": "grpc-1", "authorization": "Bearer x"}
    with tracing.rpc_span("kserve", "/inference.GRPCInferenceService/ModelInfer", "tiny", metadata) as facts:
        assert request_context.current() is facts and facts.request_id == "grpc-1"
        request_context.record_generation(generation(seq()))
        facts.status = 0
    assert request_context.current() is None and facts.trace_id == TRACE_ID
    span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "grpc-1", "the rpc span")
    assert span.name == "inference.GRPCInferenceService/ModelInfer" and span.parent_span_id == PARENT_ID
    assert span.attributes["rpc.system"] == "grpc" and span.attributes["rpc.method"] == "ModelInfer"
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.attributes["lmiserve.protocol"] == "kserve"
    assert span.attributes["gen_ai.usage.output_tokens"] == 4 and span.status_code == 0
    receiver.wait_for(lambda s: len(receiver.children(span)) == 3, "the phases")


def test_a_sampled_out_caller_gets_no_span_but_its_trace_id_in_the_access_line(started: Tracing, receiver: Receiver):
    facts = facts_of(generation(seq()), request_id="unsampled")
    started.record_http({"headers": [(b"traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00".encode())]}, facts)
    started.record_http({"headers": []}, facts_of(request_id="after"))
    receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "after", "the next span")
    assert facts.trace_id == TRACE_ID
    assert not receiver.find(lambda s: s.trace_id == TRACE_ID)


def test_only_the_grpc_codes_that_are_the_servers_fault_fail_the_span(started: Tracing, receiver: Receiver):
    for request_id, code in (("invalid", 3), ("internal", 13)):
        with tracing.rpc_span("kserve", "ModelInfer", "tiny", {"x-request-id": request_id}) as facts:
            facts.status = code
    invalid = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "invalid", "INVALID_ARGUMENT")
    internal = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "internal", "INTERNAL")
    assert invalid.status_code == 0 and invalid.attributes["rpc.grpc.status_code"] == 3
    assert internal.status_code == 2 and internal.attributes["error.type"] == "13"


def test_rpc_span_keeps_facts_already_bound_and_marks_a_failure(started: Tracing, receiver: Receiver):
    bound = RequestFacts("mine")
    token = request_context.bind(bound)
    try:
        with pytest.raises(ValueError), tracing.rpc_span("kserve", "ModelInfer", None, {}) as facts:
            assert facts is bound
            raise ValueError("bad tensor")
    finally:
        request_context.unbind(token)
    span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == "mine", "the rpc span")
    assert span.status_code == 2 and span.attributes["error.type"] == "ValueError"


def test_rpc_span_is_a_no_op_when_tracing_is_off():
    assert tracing.active() is None
    with tracing.rpc_span("kserve", "ModelInfer", "tiny", {"traceparent": TRACEPARENT}) as nothing:
        assert nothing is None and request_context.current() is None


def test_a_collector_that_is_down_costs_the_stop_no_more_than_its_timeout(monkeypatch: pytest.MonkeyPatch):
    """Spans queued for a collector that refuses connections: `stop` gives up on them (the exporter is
    aborted) instead of retrying for the SDK's 30 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")
    traced = Tracing(f"http://127.0.0.1:{free_port()}", "grpc")
    traced.start()
    exporting = traced._exporting
    assert exporting is not None
    for _ in range(3):
        traced.record_http({"headers": []}, facts_of(generation(seq())))
    traced.stop(timeout=0.05)  # an export to a refused port retries after ~1 s: it is still at it
    assert exporting.exporter.aborted and not traced.on


def test_tracing_off_imports_nothing_of_opentelemetry():
    code = (
        "import sys\n"
        "from lmiserve.config import Settings\n"
        "from lmiserve.server.app import create_app\n"
        "app = create_app(Settings.from_options({}))\n"
        "assert app.state.tracing is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_span_that_cannot_be_made_costs_the_request_nothing(started: Tracing, monkeypatch: pytest.MonkeyPatch):
    def broken(*args: object) -> str:
        raise RuntimeError("exporter bug")

    assert started._exporting is not None
    monkeypatch.setattr(started._exporting, "emit", broken)
    facts = facts_of(generation(seq()))
    started.record_http({"headers": []}, facts)  # logged, not raised
    with tracing.rpc_span("kserve", "ModelInfer", "tiny", {}) as rpc:
        rpc.status = 0
    assert facts.trace_id is None and rpc.trace_id is None
