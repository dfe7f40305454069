"""A real OTLP trace receiver in the test process, standing in for an OpenTelemetry Collector:

    with otlp_grpc_receiver() as receiver:           # OTLP/gRPC: opentelemetry-proto's TraceService on grpcio
        ... a server started with --otlp-traces-endpoint receiver.endpoint ...
        span = receiver.wait_for(lambda s: s.attributes.get("lmiserve.request_id") == rid, "the span")

`otlp_http_receiver()` is the same over OTLP/HTTP (``POST /v1/traces``, protobuf bodies). Every span
received is kept, decoded into a `Span` (ids as hex, attributes as Python values).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from helpers.server import free_port
from helpers.waiting import wait_until

SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class Span:
    name: str
    kind: str  # "SERVER", "INTERNAL", ...
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    trace_state: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any]
    scope: str  # the instrumentation scope's name

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        name=span.name,
                        kind=SPAN_KINDS.get(span.kind, str(span.kind)),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        trace_state=span.trace_state,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        status_code=span.status.code,
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return spans


@dataclass
class Receiver:
    endpoint: str  # what --otlp-traces-endpoint takes
    spans: list[Span] = field(default_factory=list)
    exports: int = 0  # export requests received
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        decoded = decode(request)
        with self._lock:
            self.spans.extend(decoded)
            self.exports += 1

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def find(self, condition: Callable[[Span], bool]) -> list[Span]:
        return [s for s in self.snapshot() if condition(s)]

    def wait_for(self, condition: Callable[[Span], bool], what: str) -> Span:
        """The first span received that meets `condition` (waits for it)."""
        wait_until(lambda: bool(self.find(condition)), what)
        return self.find(condition)[0]

    def trace(self, trace_id: str) -> list[Span]:
        return self.find(lambda s: s.trace_id == trace_id)

    def children(self, parent: Span) -> dict[str, Span]:
        """The spans whose parent is `parent`, by name."""
        return {s.name: s for s in self.find(lambda s: s.parent_span_id == parent.span_id)}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the service's method name
        self.receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def otlp_grpc_receiver(host: str = "127.0.0.1") -> Iterator[Receiver]:
    """OTLP/gRPC on a free port (insecure); `endpoint` is ``http://host:port``."""
    port = free_port(host)
    receiver = Receiver(f"http://{host}:{port}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    try:
        yield receiver
    finally:
        server.stop(grace=None)


@contextlib.contextmanager
def otlp_http_receiver(host: str = "127.0.0.1") -> Iterator[Receiver]:
    """OTLP/HTTP (protobuf bodies) on a free port; `endpoint` is ``http://host:port`` (the server adds
    ``/v1/traces``); requests to another path answer 404 and are not counted."""
    port = free_port(host)
    receiver = Receiver(f"http://{host}:{port}")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            receiver.add(request)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
