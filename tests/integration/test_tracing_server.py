"""OpenTelemetry traces from a real `lmiserve serve` (tiny model) to a real OTLP receiver in the test process
(tests/helpers/otlp_receiver.py: opentelemetry-proto's TraceService on grpcio, and OTLP/HTTP).

Every request goes out with the caller's W3C ``traceparent`` and its own X-Request-Id; the test waits for
its SERVER span (by ``lmiserve.request_id``) and checks the caller's trace, the GenAI attributes, the
``queue``/``prefill``/``decode`` children and the access line (same request id, the trace id). A server
whose collector is down answers every request.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers.otlp_receiver import Receiver, Span, otlp_grpc_receiver, otlp_http_receiver
from helpers.server import free_port, on_a_free_port, read_log, run_server
from helpers.waiting import wait_until

TIMEOUT = 60.0
PARENT_ID = "b7ad6b7169203331"
LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>\S+)(?: \[(?P<id>[^\]]+)\])?: (?P<message>.*)$")
PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
# exported within 100 ms of a span's end (the SDK's default is 5 s)
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def grpc_served() -> bool:
    """Whether `lmiserve serve --grpc-port` serves the Open Inference Protocol yet (issue #42 part 1)."""
    try:
        from lmiserve.server.app import grpc_services

        grpc_services()  # imports the servicers
    except (ImportError, AttributeError):
        return False
    return True


GRPC_WIRED = grpc_served()


@dataclass
class Traced:
    url: str
    receiver: Receiver
    log: Path
    client: httpx.Client
    grpc_port: int | None = None

    def access(self, request_id: str) -> dict[str, str]:
        """The text access line of `request_id` (waits for it), as its logfmt fields."""

        def lines() -> list[str]:
            found = []
            for line in read_log(self.log):
                m = LINE.match(line)
                if m and m["id"] == request_id and m["logger"] == "lmiserve.access":
                    found.append(m["message"])
            return found

        wait_until(lambda: bool(lines()), "the access line")
        (message,) = lines()
        return {k: json.loads(v) if v.startswith('"') else v for k, v in PAIR.findall(message)}

    def span(self, request_id: str) -> Span:
        return self.receiver.wait_for(
            lambda s: s.kind == "SERVER" and s.attributes.get("lmiserve.request_id") == request_id, "the server span"
        )

    def phases(self, span: Span) -> dict[str, Span]:
        wait_until(lambda: len(self.receiver.children(span)) == 3, "its queue, prefill and decode spans")
        return self.receiver.children(span)


def caller() -> tuple[str, str, dict[str, str]]:
    """A request id, a trace id and the headers that carry them (the caller's span is PARENT_ID)."""
    trace_id = uuid.uuid4().hex
    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    return request_id, trace_id, {"X-Request-Id": request_id, "traceparent": f"00-{trace_id}-{PARENT_ID}-01"}


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    log = tmp_path_factory.mktemp("traced") / "server.log"
    with otlp_grpc_receiver() as receiver, contextlib.ExitStack() as stack:
        args = ["--model-id", str(tiny_model_dir), "--otlp-traces-endpoint", receiver.endpoint]

        def start(grpc_port: int | None) -> str:
            ports = [] if grpc_port is None else ["--grpc-port", str(grpc_port)]
            return stack.enter_context(run_server([*args, *ports], env=FAST_EXPORT, stderr_path=log))

        # the gRPC port is picked again if another process took it before the server's bind
        url, grpc_port = on_a_free_port(start) if GRPC_WIRED else (start(None), None)
        client = stack.enter_context(httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False))
        yield Traced(url, receiver, log, client, grpc_port)


def check_request(traced: Traced, request_id: str, trace_id: str, route: str, protocol: str) -> Span:
    """The span of a finished request in its caller's trace, its three phases, and its access line."""
    span = traced.span(request_id)
    assert (span.name, span.trace_id, span.parent_span_id) == (f"POST {route}", trace_id, PARENT_ID)
    attrs = span.attributes
    assert (attrs["http.route"], attrs["http.response.status_code"], attrs["lmiserve.protocol"]) == (
        route,
        200,
        protocol,
    )
    assert attrs["gen_ai.request.model"] == "tiny" and span.status_code == 0
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attrs["gen_ai.response.time_to_first_chunk"] == attrs["gen_ai.latency.time_to_first_token"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] < attrs["gen_ai.latency.time_to_first_token"]
    phases = traced.phases(span)
    queue, prefill, decode = phases["queue"], phases["prefill"], phases["decode"]
    assert all(p.trace_id == trace_id and p.kind == "INTERNAL" for p in phases.values())
    assert span.start_ns <= queue.start_ns <= queue.end_ns <= prefill.start_ns <= prefill.end_ns
    assert prefill.end_ns <= decode.start_ns <= decode.end_ns <= span.end_ns
    assert decode.attributes["gen_ai.usage.output_tokens"] == attrs["gen_ai.usage.output_tokens"]
    fields = traced.access(request_id)
    assert fields["trace_id"] == trace_id and fields["route"] == route
    assert int(fields["prompt_tokens"]) == attrs["gen_ai.usage.input_tokens"]
    assert float(fields["time_to_first_token"]) == attrs["gen_ai.latency.time_to_first_token"]
    return span


def test_an_openai_chat_completion(traced: Traced):
    request_id, trace_id, headers = caller()
    headers["tracestate"] = "vendor=1"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}
    r = traced.client.post("/v1/chat/completions", json={**body, "temperature": 0.5, "top_p": 0.9}, headers=headers)
    assert r.status_code == 200, r.text
    span = check_request(traced, request_id, trace_id, "/v1/chat/completions", "openai")
    attrs = span.attributes
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"], attrs["gen_ai.request.top_p"]) == (
        4,
        0.5,
        0.9,
    )
    usage = r.json()["usage"]
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert span.trace_state == "vendor=1"
    assert span.resource["service.name"] == "lmiserve"


def test_a_tgi_stream(traced: Traced):
    request_id, trace_id, headers = caller()
    body = {"inputs": "Deep learning", "parameters": {"max_new_tokens": 5}}
    with traced.client.stream("POST", "/generate_stream", json=body, headers=headers) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 5
    span = check_request(traced, request_id, trace_id, "/generate_stream", "tgi")
    attrs = span.attributes
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (5, 0.0)  # greedy
    assert attrs["gen_ai.usage.output_tokens"] == 5


def test_an_lmi_request(traced: Traced):
    request_id, trace_id, headers = caller()
    # Sampled, so the tiny random model may draw its EOS: ignore it, the span must say "length".
    parameters = {"max_new_tokens": 3, "do_sample": True, "top_p": 0.8, "ignore_eos_token": True}
    body = {"inputs": "The quick brown fox", "parameters": parameters}
    r = traced.client.post("/invocations", json=body, headers=headers)
    assert r.status_code == 200, r.text
    span = check_request(traced, request_id, trace_id, "/invocations", "lmi")
    assert (span.attributes["gen_ai.request.top_p"], span.attributes["gen_ai.usage.output_tokens"]) == (0.8, 3)


def test_a_request_without_a_caller_starts_a_trace_and_probes_are_not_traced(traced: Traced):
    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    r = traced.client.post(
        "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, headers={"X-Request-Id": request_id}
    )
    assert r.status_code == 200
    span = traced.span(request_id)
    assert span.parent_span_id == "" and traced.access(request_id)["trace_id"] == span.trace_id
    assert traced.client.get("/ping", headers={"X-Request-Id": "probe-1"}).status_code == 200
    assert not traced.receiver.find(lambda s: s.attributes.get("lmiserve.request_id") == "probe-1")


@pytest.mark.skipif(not GRPC_WIRED, reason="the gRPC port (issue #42 part 1) is not served by `lmiserve serve` yet")
def test_a_grpc_infer(traced: Traced):
    import tritonclient.grpc as triton_grpc

    request_id, trace_id, headers = caller()
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{traced.grpc_port}")
    inp = triton_grpc.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"Hello there"], dtype=object))
    metadata = {"traceparent": headers["traceparent"], "x-request-id": request_id}
    result = client.infer("tiny", [inp], parameters={"max_new_tokens": 4}, headers=metadata)
    assert result.as_numpy("text_output").shape == (1,)
    span = traced.span(request_id)
    assert (span.trace_id, span.parent_span_id) == (trace_id, PARENT_ID)
    assert span.name == "inference.GRPCInferenceService/ModelInfer"
    attrs = span.attributes
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "ModelInfer" and attrs["rpc.grpc.status_code"] == 0
    assert attrs["gen_ai.request.model"] == "tiny" and attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.latency.time_to_first_token" in attrs and "gen_ai.latency.time_in_queue" in attrs
    assert set(traced.phases(span)) == {"queue", "prefill", "decode"}
    assert traced.access(request_id)["trace_id"] == trace_id


def test_otlp_over_http_and_the_trace_id_in_json_access_lines(tiny_model_dir: Path, tmp_path: Path):
    log = tmp_path / "server.log"
    with otlp_http_receiver() as receiver:
        args = ["--model-id", str(tiny_model_dir), "--log-format", "json", "--otlp-traces-endpoint", receiver.endpoint]
        env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "llm-1"}
        with run_server(args, env=env, stderr_path=log) as url:
            request_id, trace_id, headers = caller()
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT, trust_env=False)
            assert r.status_code == 200, r.text
            span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == request_id, "the span")

            def access() -> list[dict]:
                docs = [json.loads(line) for line in read_log(log) if line.startswith("{")]
                return [d for d in docs if d.get("logger") == "lmiserve.access" and d.get("request_id") == request_id]

            wait_until(lambda: bool(access()), "the access line")
    assert span.trace_id == trace_id and span.name == "POST /v1/completions"
    assert span.resource["service.name"] == "llm-1"  # OTEL_SERVICE_NAME
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    (line,) = access()
    assert line["trace_id"] == trace_id


def test_a_collector_that_is_down_fails_no_request(tiny_model_dir: Path, tmp_path: Path):
    """Nothing listens on the collector's port: every export fails (and is retried on the exporter's
    thread) while every request is answered."""
    log = tmp_path / "server.log"
    args = ["--model-id", str(tiny_model_dir), "--otlp-traces-endpoint", f"http://127.0.0.1:{free_port()}"]
    with (
        run_server(args, env=FAST_EXPORT, stderr_path=log) as url,
        httpx.Client(base_url=url, timeout=TIMEOUT) as client,
    ):

        def one(i: int) -> int:
            body = {"inputs": f"Request {i}", "parameters": {"max_new_tokens": 8}}
            return client.post("/generate", json=body).status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(48)))
        assert statuses == [200] * 48
        wait_until(lambda: any("opentelemetry.exporter" in line for line in read_log(log)), "the exporter's complaint")
