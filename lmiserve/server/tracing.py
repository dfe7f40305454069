"""OpenTelemetry traces of every request (`otlp_traces_endpoint`; docs/tracing.md): off by default, and
then free: nothing of OpenTelemetry is imported, the access middleware checks one `None`.

When on, each request becomes one SERVER span, made once the request is over from what its
`RequestFacts` (lmiserve.core.request_context) gathered, so nothing runs per token:

- REST: `lmiserve.server.access.RequestLog` calls `Tracing.record_http` before the access line (probes
  and metrics scrapes are not traced); gRPC: the front end wraps each call in `rpc_span(...)`;
- the span continues the caller's W3C trace context (``traceparent``, ``tracestate``); its trace id goes
  into the access line (`RequestFacts.trace_id`);
- its children ``queue``, ``prefill`` and ``decode`` are made of the times the engine recorded for the
  request (`RequestFacts.generations`: queued, first admitted, first token, end), with explicit start
  and end times;
- attributes: HTTP's (or RPC's), ``lmiserve.request_id`` (the access line's id), and the GenAI semantic
  conventions' (`server_attributes`).

The exporting side (TracerProvider, BatchSpanProcessor, OTLP exporter over gRPC or HTTP) is in
lmiserve.server.otlp, imported by `Tracing.start` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lmiserve.core import request_context
from lmiserve.core.request_context import CANCELLED, RequestFacts, new_request_id, usable_request_id
from lmiserve.server.spans import AttributeValue, Phase

if TYPE_CHECKING:
    from lmiserve.config import Settings
    from lmiserve.server.otlp import Exporting

log = logging.getLogger(__name__)

# The GenAI semantic conventions' names (opentelemetry-semantic-conventions 0.66b2, gen_ai_attributes)
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
# No convention names these two; vLLM's spans do, so dashboards built for vLLM read lmiserve's too
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
REQUEST_ID = "lmiserve.request_id"

# gRPC status codes that are the server's fault (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL,
# UNAVAILABLE, DATA_LOSS): a SERVER span with another code (INVALID_ARGUMENT, NOT_FOUND, ...) is not failed
GRPC_SERVER_ERRORS = frozenset({2, 4, 12, 13, 14, 15})

_TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}


# ---- what a span carries (pure functions of the request's facts) -------------------------------------
def server_attributes(facts: RequestFacts) -> dict[str, AttributeValue]:
    """The attributes every request's span carries, whatever its transport: the request id, protocol,
    model and adapter, and for a generation the GenAI conventions' settings, usage, finish reasons,
    time to first token and time in queue (seconds)."""
    attrs: dict[str, AttributeValue] = {REQUEST_ID: facts.request_id}
    if facts.protocol is not None:
        attrs["lmiserve.protocol"] = facts.protocol
    if facts.model is not None:
        attrs[GEN_AI_REQUEST_MODEL] = facts.model
    if facts.adapter:
        attrs["lmiserve.adapter"] = facts.adapter
    generations = facts.generations
    if generations:
        first = generations[0]
        attrs[GEN_AI_REQUEST_MAX_TOKENS] = first.max_new_tokens
        attrs[GEN_AI_REQUEST_TEMPERATURE] = first.temperature
        attrs[GEN_AI_REQUEST_TOP_P] = first.top_p
    prompt, generated, cached = _usage(facts)
    if prompt is not None:
        attrs[GEN_AI_USAGE_INPUT_TOKENS] = prompt
    if generated is not None:
        attrs[GEN_AI_USAGE_OUTPUT_TOKENS] = generated
    if cached:
        attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
    reasons = finish_reasons(facts)
    if reasons:
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    first_token = facts.first_token if facts.first_token is not None else _engine_first_token(facts)
    if first_token is not None:
        ttft = round(max(0.0, first_token - facts.start), 6)
        attrs[GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = ttft
        attrs[GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = ttft
    queue = phases(facts)
    if queue:
        attrs[GEN_AI_LATENCY_TIME_IN_QUEUE] = round(queue[0].end - queue[0].start, 6)
    return attrs


def finish_reasons(facts: RequestFacts) -> list[str]:
    """Why the request's sequences ended (the engine's names: length, eos_token, stop_sequence, error,
    abort), each once; ``cancelled`` when the client left first."""
    if facts.disconnected and not facts.completed:
        return [CANCELLED]
    if facts.finish_reasons:
        return list(facts.finish_reasons)
    reasons: list[str] = []
    for generation in facts.generations:
        for seq in generation.stats.sequences:
            if seq.reason.value not in reasons:
                reasons.append(seq.reason.value)
    return reasons


def _usage(facts: RequestFacts) -> tuple[int | None, int | None, int | None]:
    """Prompt, generated and cached prompt tokens: as the response pipeline counted them, else (a
    transport that does not go through it) as the engine did."""
    if facts.prompt_tokens is not None or not facts.generations:
        return facts.prompt_tokens, facts.generated_tokens, facts.cached_tokens
    stats = [g.stats for g in facts.generations]
    prompt = sum(s.prompt_tokens for s in stats)
    generated = sum(seq.generated_tokens for s in stats for seq in s.sequences)
    cached = sum(s.sequences[0].cached_tokens for s in stats if s.sequences)
    return prompt, generated, cached


def _engine_first_token(facts: RequestFacts) -> float | None:
    times = [seq.first_token for g in facts.generations for seq in g.stats.sequences if seq.first_token is not None]
    return min(times, default=None)


def phases(facts: RequestFacts) -> list[Phase]:
    """The request's time in the engine as up to three consecutive phases, over all its generations:
    ``queue`` (submitted to first admitted into the running batch), ``prefill`` (to the first token) and
    ``decode`` (to the last sequence's end). A request that never left the queue has only ``queue``;
    one that ended before its first token, no ``decode``. None without a generation."""
    generations = facts.generations
    if not generations:
        return []
    seqs = [seq for g in generations for seq in g.stats.sequences]
    arrival = min(g.stats.arrival for g in generations)
    end = max((seq.finished for seq in seqs), default=max(g.stats.finished for g in generations))
    scheduled = min((seq.scheduled for seq in seqs if seq.scheduled is not None), default=None)
    first_token = min((seq.first_token for seq in seqs if seq.first_token is not None), default=None)
    queued: dict[str, AttributeValue] = {"lmiserve.sequences": len(seqs)}
    errors = [g.stats.error for g in generations if g.stats.error is not None]
    if errors:
        queued["error.type"] = type(errors[0]).__name__
    result = [Phase("queue", arrival, max(arrival, scheduled if scheduled is not None else end), queued)]
    if scheduled is None:
        return result
    prompt, generated, cached = _usage(facts)
    prefill_end = max(scheduled, first_token if first_token is not None else end)
    prefilled: dict[str, AttributeValue] = {}
    if prompt is not None:
        prefilled[GEN_AI_USAGE_INPUT_TOKENS] = prompt
    if cached:
        prefilled[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
    result.append(Phase("prefill", scheduled, prefill_end, prefilled))
    if first_token is not None:
        decoded: dict[str, AttributeValue] = {}
        if generated is not None:
            decoded[GEN_AI_USAGE_OUTPUT_TOKENS] = generated
        result.append(Phase("decode", prefill_end, max(prefill_end, end), decoded))
    return result


def http_attributes(scope: Mapping[str, Any], facts: RequestFacts) -> dict[str, AttributeValue]:
    """HTTP's semantic-convention attributes of an ASGI request (no query string: it may hold secrets)."""
    attrs: dict[str, AttributeValue] = {
        "http.request.method": facts.method,
        "url.path": facts.path,
        "url.scheme": str(scope.get("scheme", "http")),
    }
    if facts.route is not None:
        attrs["http.route"] = facts.route
    if facts.status is not None:
        attrs["http.response.status_code"] = facts.status
    if version := scope.get("http_version"):
        attrs["network.protocol.version"] = str(version)
    client = scope.get("client")
    if client:
        attrs["client.address"] = str(client[0])
    for name, value in scope.get("headers", ()):
        if name == b"user-agent":
            attrs["user_agent.original"] = value.decode("latin-1")
            break
    return attrs


def http_span_name(facts: RequestFacts) -> str:
    """``METHOD route`` (the matched path template), or the method alone when no route matched."""
    return f"{facts.method} {facts.route}" if facts.route else facts.method


def trace_headers(headers: Any) -> dict[str, str]:
    """The W3C trace context headers of ASGI `headers` (``traceparent``, ``tracestate``)."""
    carrier: dict[str, str] = {}
    for name, value in headers:
        key = _TRACE_HEADERS.get(name)
        if key is not None and key not in carrier:
            carrier[key] = value.decode("latin-1")
    return carrier


def rpc_names(method: str) -> tuple[str | None, str]:
    """A gRPC method's service and name: ``/inference.GRPCInferenceService/ModelInfer`` (or without its
    leading slash) -> (``inference.GRPCInferenceService``, ``ModelInfer``); a bare name has no service."""
    full = method.lstrip("/")
    if "/" in full:
        service, name = full.rsplit("/", 1)
        return service, name
    return None, full


# ---- the switch -----------------------------------------------------------------------------------
class Tracing:
    """The server's tracing: built by `create_app` when `otlp_traces_endpoint` is set, started and stopped
    by its lifespan. Until `start` (and after `stop`) it records nothing."""

    def __init__(self, endpoint: str, protocol: str) -> None:
        self.endpoint = endpoint
        self.protocol = protocol
        self._exporting: Exporting | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracing | None:
        """None when tracing is off (no endpoint)."""
        if not settings.otlp_traces_endpoint:
            return None
        return cls(settings.otlp_traces_endpoint, settings.otlp_traces_protocol)

    @property
    def on(self) -> bool:
        return self._exporting is not None

    def start(self) -> None:
        """Set up the exporter (lmiserve.server.otlp; the first import of OpenTelemetry); this server's
        gRPC calls are traced from now on (`rpc_span`). One that cannot be set up is logged and leaves
        tracing off: traces never stop a server from serving."""
        global _active
        from lmiserve.server.otlp import Exporting

        try:
            self._exporting = Exporting(self.endpoint, self.protocol)
        except Exception as exc:  # noqa: BLE001 - tracing is optional: the server serves without it
            log.error("tracing is off: cannot export traces to %s (%s): %s", self.endpoint, self.protocol, exc)
            return
        _active = self
        log.info("exporting spans to %s over OTLP/%s", self._exporting.endpoint, self.protocol)

    def stop(self, timeout: float | None = None) -> None:
        """Export the spans still queued, for `timeout` seconds at most (blocking: run it off the event
        loop); then stop recording."""
        global _active
        exporting, self._exporting = self._exporting, None
        if _active is self:
            _active = None
        if exporting is not None:
            exporting.shutdown(timeout)

    def record_http(self, scope: Mapping[str, Any], facts: RequestFacts) -> None:
        """The SERVER span of an HTTP request that is over (its access line comes next: the trace id is
        in `facts.trace_id` then)."""
        exporting = self._exporting
        if exporting is None:
            return
        try:
            attrs = http_attributes(scope, facts)
            attrs.update(server_attributes(facts))
            error = str(facts.status) if facts.status is not None and facts.status >= 500 else None
            carrier = trace_headers(scope.get("headers", ()))
            self._emit(exporting, http_span_name(facts), carrier, facts, attrs, error)
        except Exception:  # noqa: BLE001 - a span that cannot be made never fails the request or its log line
            log.exception("the span of request %s could not be recorded", facts.request_id)

    def record_rpc(
        self, method: str, metadata: Mapping[str, str], facts: RequestFacts, error: BaseException | None
    ) -> None:
        """The SERVER span of a gRPC call that is over. `facts.status`, when the front end set it, is
        the call's gRPC status code (0 = OK); as RPC's conventions say, only the codes that are the
        server's fault (`GRPC_SERVER_ERRORS`) or an exception that escaped the call (not a cancellation)
        mark the span failed."""
        exporting = self._exporting
        if exporting is None:
            return
        try:
            service, name = rpc_names(method)
            attrs: dict[str, AttributeValue] = {"rpc.system": "grpc", "rpc.method": name}
            if service is not None:
                attrs["rpc.service"] = service
            if facts.status is not None:
                attrs["rpc.grpc.status_code"] = facts.status
            attrs.update(server_attributes(facts))
            failure = None
            if facts.status in GRPC_SERVER_ERRORS:
                failure = str(facts.status)
            elif error is not None and not isinstance(error, (asyncio.CancelledError, GeneratorExit)):
                failure = type(error).__name__
            carrier = {key: value for key, value in metadata.items() if key in ("traceparent", "tracestate")}
            self._emit(exporting, f"{service}/{name}" if service else name, carrier, facts, attrs, failure)
        except Exception:  # noqa: BLE001 - a span that cannot be made never fails the call or its log line
            log.exception("the span of request %s could not be recorded", facts.request_id)

    @staticmethod
    def _emit(
        exporting: Exporting,
        name: str,
        carrier: dict[str, str],
        facts: RequestFacts,
        attrs: dict[str, AttributeValue],
        error: str | None,
    ) -> None:
        end = facts.end if facts.end is not None else time.monotonic()
        facts.trace_id = exporting.emit(name, carrier, facts.start, end, attrs, phases(facts), error)


_active: Tracing | None = None  # the started Tracing of this process (the gRPC front end's, via rpc_span)


def active() -> Tracing | None:
    """The started tracing of this server, if any."""
    return _active


def rpc_span(
    protocol: str, method: str, model: str | None, metadata: Mapping[str, str]
) -> contextlib.AbstractContextManager[Any]:
    """Trace one gRPC call: a SERVER span continuing the ``traceparent`` of the call's `metadata`
    (lower-case keys), with the same child spans and attributes as a REST request's. Binds a
    `RequestFacts` for the call unless one is bound already (the engine records the generations there;
    the caller may `observe` events and note the model; `facts.status`: the gRPC status code). A no-op
    (`contextlib.nullcontext`) when tracing is off."""
    tracing = _active
    if tracing is None or not tracing.on:
        return contextlib.nullcontext()
    return _traced_rpc(tracing, protocol, method, model, metadata)


@contextlib.contextmanager
def _traced_rpc(
    tracing: Tracing, protocol: str, method: str, model: str | None, metadata: Mapping[str, str]
) -> Iterator[RequestFacts]:
    facts = request_context.current()
    token = None
    if facts is None:
        sent = metadata.get("x-request-id", "").strip()
        facts = RequestFacts(sent if usable_request_id(sent) else new_request_id(), method="POST", path=method)
        token = request_context.bind(facts)
    if facts.protocol is None:
        facts.protocol = protocol
    if facts.model is None:
        facts.model = model
    error: BaseException | None = None
    try:
        yield facts
    except BaseException as exc:
        error = exc
        raise
    finally:
        if facts.end is None:
            facts.end = time.monotonic()
        tracing.record_rpc(method, metadata, facts, error)
        if token is not None:
            request_context.unbind(token)
