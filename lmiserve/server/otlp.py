"""The OpenTelemetry SDK side of tracing (lmiserve.server.tracing imports this only when tracing is on).

One private `TracerProvider` (the global one is left alone) with a `BatchSpanProcessor` and the OTLP
exporter, over gRPC or HTTP (``http/protobuf``). A collector that is down or slow never reaches a
request: a span that ends is appended to the processor's bounded queue (``OTEL_BSP_MAX_QUEUE_SIZE``,
2048; beyond it spans are dropped) and exported in batches by the processor's own thread; one export,
its retries included, gives up after `EXPORT_TIMEOUT` seconds (unless ``OTEL_EXPORTER_OTLP_TIMEOUT`` or
``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` says otherwise). The SDK's own complaints about it (an export
that failed, a full queue) are logged once a minute at most (`_Throttle`). At stop, the spans still
queued get `SHUTDOWN_TIMEOUT` seconds; then the export in flight is abandoned.

The resource is the SDK's (``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SERVICE_NAME``) with service.name
``lmiserve`` when neither names the service; sampling is the SDK's (``OTEL_TRACES_SAMPLER``; by default
a span is sampled when its caller's was, or when it has none).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lmiserve import __version__
from lmiserve.server.spans import AttributeValue, Phase

log = logging.getLogger(__name__)

SERVICE = "lmiserve"
EXPORT_TIMEOUT = 5.0  # seconds one export may take, its retries included
SHUTDOWN_TIMEOUT = 3.0  # seconds the stop waits for the spans still queued
THROTTLE_INTERVAL = 60.0  # seconds between two log lines of the SDK saying the same thing
TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
TRACES_PATH = "/v1/traces"


def exporter_endpoint(endpoint: str, protocol: str) -> str:
    """The URL the exporter sends to: for ``http/protobuf``, ``/v1/traces`` added to an endpoint without
    a path (and ``http://`` to one without a scheme); for ``grpc``, the endpoint as given."""
    if protocol != "http/protobuf":
        return endpoint
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path=TRACES_PATH)
    return urlunsplit(parts)


def make_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP span exporter for `protocol` (``grpc`` or ``http/protobuf``); the rest of its
    configuration (headers, TLS, compression) comes from OpenTelemetry's environment variables."""
    timeout = None if any(os.environ.get(name) for name in TIMEOUT_VARIABLES) else EXPORT_TIMEOUT
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter(endpoint=endpoint, timeout=timeout)


def resource() -> Resource:
    """The SDK's resource (from the environment) with lmiserve's name and version where it names none."""
    found = Resource.create({SERVICE_VERSION: __version__})
    name = found.attributes.get(SERVICE_NAME)
    if not name or str(name).startswith("unknown_service"):
        found = found.merge(Resource({SERVICE_NAME: SERVICE}))
    return found


class _Abortable(SpanExporter):
    """Wraps the OTLP exporter: `abort` makes the export in flight stop retrying and every later one
    fail at once (the stop's deadline passed); `shutdown` reaches the wrapped exporter once."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.aborted = False
        self._closed = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.aborted:
            return SpanExportResult.FAILURE
        return self.inner.export(spans)

    def abort(self) -> None:
        self.aborted = True
        self.shutdown()  # interrupts the wrapped exporter's wait between retries

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _Throttle(logging.Filter):
    """Lets one record of each (logger, message) through per `interval` seconds: a collector that is down
    makes the SDK complain about every batch (and a full queue about every span)."""

    def __init__(self, interval: float = THROTTLE_INTERVAL) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return False
        self._last[key] = now
        return True


THROTTLE = _Throttle()


def _throttle_sdk_logs() -> None:
    """`THROTTLE` on every OpenTelemetry logger there is (they exist once the SDK and exporters are
    imported; a logger's filters see only its own records)."""
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith("opentelemetry")]
    for name in names:
        logging.getLogger(name).addFilter(THROTTLE)


class Exporting:
    """The provider, its batch processor and exporter, and the tracer the spans come from."""

    def __init__(self, endpoint: str, protocol: str) -> None:
        self.endpoint = exporter_endpoint(endpoint, protocol)
        self.exporter = _Abortable(make_exporter(self.endpoint, protocol))
        self.provider = TracerProvider(resource=resource(), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("lmiserve", __version__)
        self.propagator = TraceContextTextMapPropagator()
        # time.monotonic() (the request facts' clock) -> nanoseconds since the epoch (the spans')
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        _throttle_sdk_logs()

    def epoch_ns(self, monotonic: float) -> int:
        return self._offset_ns + int(monotonic * 1e9)

    def emit(
        self,
        name: str,
        carrier: dict[str, str],
        start: float,
        end: float,
        attributes: dict[str, AttributeValue],
        phases: Sequence[Phase],
        error: str | None,
    ) -> str:
        """Record one SERVER span from `start` to `end` (monotonic seconds), child of the caller's span
        that `carrier` (``traceparent``, ``tracestate``) names, and its `phases` as INTERNAL children;
        `error` (a status code or an exception's name) marks it failed. Its trace id, as 32 hex digits."""
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes, start_time=self.epoch_ns(start)
        )
        if phases:
            inside = trace.set_span_in_context(span)
            for phase in phases:
                child = self.tracer.start_span(
                    phase.name,
                    context=inside,
                    kind=SpanKind.INTERNAL,
                    attributes=phase.attributes,
                    start_time=self.epoch_ns(phase.start),
                )
                child.end(end_time=self.epoch_ns(phase.end))
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=self.epoch_ns(end))
        return format(span.get_span_context().trace_id, "032x")

    def shutdown(self, timeout: float | None = None) -> None:
        """Export what is queued within `timeout` seconds (`SHUTDOWN_TIMEOUT`), then give up on the rest."""
        timeout = SHUTDOWN_TIMEOUT if timeout is None else timeout
        done = threading.Event()

        def run() -> None:
            try:
                self.provider.shutdown()
            except Exception:  # noqa: BLE001 - the server is stopping: a failed flush is only logged
                log.exception("tracing: stopping the exporter failed")
            finally:
                done.set()

        threading.Thread(target=run, name="lmiserve-tracing-stop", daemon=True).start()
        if not done.wait(timeout):
            log.warning(
                "tracing: the collector at %s took no spans within %g s; the rest are dropped", self.endpoint, timeout
            )
            self.exporter.abort()
            done.wait(timeout)
