"""The server's settings: where it listens, what it logs and traces, how it stops, who may call it and
which models and adapters its management APIs may load."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from lmiserve.config.settings_types import FieldGroup, LogFormat, LogLevel, OtlpProtocol


class ServerFields(FieldGroup):
    """Listening, logging, tracing, draining, security and the management APIs."""

    host: str = Field("0.0.0.0", description="Address the HTTP server listens on.")
    port: int = Field(8080, ge=1, le=65535, description="Port the HTTP server listens on.")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Also serve `GET /metrics` (Prometheus) on this port, without the API key; `/metrics` on the "
            "serving port stays, with the key when one is set (see docs/metrics.md and SECURITY.md)."
        ),
    )
    grpc_port: int = Field(
        8081,
        ge=0,
        le=65535,
        description=(
            "Port of the Open Inference Protocol over gRPC (KServe's `grpc_predict_v2`, the service Triton "
            "serves: `tritonclient.grpc`, KServe's `InferenceGRPCClient`), over the same models as REST; `0` = off. "
            "See docs/protocols/kserve.md."
        ),
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description=(
            "Export OpenTelemetry traces of every request to this OTLP collector (vLLM's `otlp_traces_endpoint`, "
            "TGI's `otlp_endpoint`), e.g. `http://otel-collector:4317`; also read from "
            "`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and `OTEL_EXPORTER_OTLP_ENDPOINT`. Unset = no tracing (and no "
            "cost). See docs/tracing.md."
        ),
    )
    otlp_traces_protocol: OtlpProtocol = Field(
        "grpc",
        description=(
            "How traces reach the collector: `grpc` (OTLP/gRPC, port 4317) or `http/protobuf` (OTLP/HTTP, port "
            "4318; `/v1/traces` is added to an endpoint without a path)."
        ),
    )
    log_level: LogLevel = Field(
        "info", description="Log level: `debug` (also lists every option at start-up), `info`, `warning` or `error`."
    )
    log_format: LogFormat = Field(
        "text",
        description="`text`, or `json`: one JSON object per log line, for log pipelines (see docs/logs.md).",
    )
    request_id_header_key: str = Field(
        "X-Request-Id",
        pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
        description=(
            "Request header read first for a client's request id (then `X-Request-Id`, "
            "`X-Amzn-SageMaker-Inference-Id`, `X-Amzn-RequestId`); the response echoes the id under it as well "
            "as `X-Request-Id`. LMI's key: set it to `X-Amzn-SageMaker-Inference-Id` as DJL Serving does on "
            "SageMaker, though that header is read anyway."
        ),
        json_schema_extra={"allowed": "an HTTP header name"},
    )
    drain_timeout: float = Field(
        25.0,
        ge=0,
        description=(
            "Seconds a stopping server (SIGTERM or SIGINT) lets requests in flight (streams included) finish "
            "while every route but `/v2/health/live` answers 503; then it ends what still runs and exits 0. "
            "Keep it below the orchestrator's kill delay (SageMaker 30 s, Kubernetes "
            '`terminationGracePeriodSeconds`); see docs/shutdown.md, "Graceful drain".'
        ),
    )
    keep_alive_timeout: int = Field(
        65,
        ge=1,
        description=(
            "Seconds the server keeps an idle kept-alive HTTP connection open, on the serving port and `metrics_port` "
            "(uvicorn's `timeout_keep_alive`; "
            "vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`). Longer than a load balancer's or a client pool's idle timeout "
            "(AWS ALB 60 s, httpx 5 s), so the client, not the server, closes idle connections: a server that closes "
            "first races a request the client sends on the same connection, which then fails with a reset."
        ),
    )
    api_key: str | None = Field(
        None,
        description=(
            "When set, every route but the health and readiness probes requires "
            "`Authorization: Bearer <key>` (the Anthropic routes also take `x-api-key: <key>`; 401 in the "
            "protocol's shape otherwise); see SECURITY.md. "
            "Logged as `<hidden>`."
        ),
    )
    max_request_size: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description=(
            "Largest request body in bytes on every route (LMI's key and default, 64 MiB); a larger one gets "
            "413 in the protocol's shape, from `Content-Length` before anything is read, or as soon as a "
            "chunked body passes it."
        ),
    )
    max_header_size: int = Field(
        64 * 1024,
        ge=1024,
        description=(
            "Largest request headers in bytes (each header counts its name, value and 4); larger ones get 431 "
            "in the protocol's shape. A request head over 4 times this size is cut off with a bare 400."
        ),
    )
    enable_management_api: bool = Field(
        True,
        description=(
            "Serve LMI's management API (`GET/POST/DELETE /models`) and the LoRA adapters APIs (`/adapters`, "
            "`/models/{m}/adapters`, vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`); `false` "
            "removes those routes (404). Registration loads only from `model_store` or `allowed_model_paths`."
        ),
    )
    model_store: str | None = Field(
        None,
        description=(
            "Serve every model sub-directory of this directory (each named after its directory); `POST /models` "
            "may load models from it too (a relative `url` is taken relative to it)."
        ),
    )
    allowed_model_paths: str | None = Field(
        None,
        description=(
            "Comma-separated directories `POST /models` (and the adapters APIs) may also load from; a path "
            "outside them and `model_store` gets 403."
        ),
    )
    allowed_model_urls: str | None = Field(
        None,
        description=(
            "Remote models and adapters the management APIs may fetch (`POST /models?url=`, the adapters APIs): "
            "comma-separated URL prefixes such as `s3://my-bucket/models/`, `gs://my-bucket/`, `hf://my-org/` "
            "(a Hub id `org/name` is matched as `hf://org/name`). Unset = none: a caller can never make the "
            "server fetch a URL of its choosing. Models named at start are the operator's and need no entry."
        ),
    )

    def model_roots(self) -> list[Path]:
        """The directories POST /models may load from: model_store and allowed_model_paths, resolved."""
        given = [self.model_store, *(self.allowed_model_paths or "").split(",")]
        return [Path(p.strip()).expanduser().resolve() for p in given if p and p.strip()]
