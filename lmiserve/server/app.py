"""The starlette application: routes table, lifespan (model loads in the background), 404 shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from lmiserve.config import Settings
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService
from lmiserve.protocols import invocations
from lmiserve.protocols.anthropic import routes as anthropic
from lmiserve.protocols.lmi import routes as lmi
from lmiserve.protocols.lmi.errors import MANAGEMENT, frontend_error_body
from lmiserve.protocols.openai import embeddings as openai_embeddings
from lmiserve.protocols.openai import models as openai_models
from lmiserve.protocols.openai import rerank as vllm_rerank
from lmiserve.protocols.openai import responses_api as openai_responses
from lmiserve.protocols.openai import routes as openai
from lmiserve.protocols.openai import tokenize as vllm_tokenize
from lmiserve.protocols.tei import routes as tei
from lmiserve.protocols.tensor import routes as tensor
from lmiserve.protocols.tgi import routes as tgi
from lmiserve.server import openapi, playground
from lmiserve.server.access import RequestLog
from lmiserve.server.drain import Drain
from lmiserve.server.errors import protocol_routes
from lmiserve.server.metrics import Metrics
from lmiserve.server.metrics import port as metrics_port
from lmiserve.server.responses import raw_response
from lmiserve.server.tracing import Tracing

if TYPE_CHECKING:
    from lmiserve.server.grpc_server import AddServices

log = logging.getLogger(__name__)


# vLLM's body on TGI's /tokenize (the body tells which protocol answers)
VLLM_TOKENIZE = tgi.OtherTokenize(
    vllm_tokenize.invoke_tokenize,
    vllm_tokenize.TOKENIZE_BODIES,
    vllm_tokenize.TokenizeResponse,
    (vllm_tokenize.RENDERER,),
)


def routes(settings: Settings, metrics: Metrics | None = None) -> list[BaseRoute]:
    """The route table; the first match wins, so Vertex AI's configured paths come first and the exact
    LMI, TGI and OpenAI routes before the tensor protocols' patterns. `metrics`: the app's collectors
    (a table built only to be read, e.g. for the API document, gets empty ones)."""
    metrics = metrics if metrics is not None else Metrics(list)
    return [
        *tensor.configured_routes(settings),
        *lmi.ping_routes(),
        *metrics.routes(),
        *playground.routes(),
        *invocations.routes(),
        *lmi.routes(settings),
        *tgi.routes(tokenize_other=VLLM_TOKENIZE),
        *openai.routes(),
        *openai_responses.routes(),
        *openai_models.routes(settings),
        *openai_embeddings.routes(),
        *vllm_rerank.routes(),
        *anthropic.routes(),
        *vllm_tokenize.routes(),
        *tei.routes(),
        *tensor.routes(),
        *protocol_routes(MANAGEMENT, [], public=openapi.routes()),
    ]


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message, kind = "Requested resource is not found, please refer to API document.", "ResourceNotFoundException"
    elif exc.status_code == 405:
        message, kind = "Requested method is not allowed, please refer to API document.", "MethodNotAllowedException"
    else:
        message, kind = str(exc.detail), "BadRequestException"
    return raw_response(frontend_error_body(exc.status_code, kind, message), exc.status_code)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Anything unforeseen still answers in LMI's JSON error shape (and is logged with its traceback)."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return raw_response(frontend_error_body(500, "InternalServerException", str(exc) or type(exc).__name__), 500)


class LmiServeApp(Starlette):
    """Starlette with `RequestLog` (request ids, the access line, the request metrics) outside even its
    error middleware, so the unforeseen 500 carries the request id and is logged and counted too."""

    def build_middleware_stack(self) -> ASGIApp:
        metrics = getattr(self.state, "metrics", None)  # create_app sets it; a bare LmiServeApp counts nothing
        on_done = metrics.requests.observe if metrics is not None else None
        tracing = getattr(self.state, "tracing", None)
        return RequestLog(super().build_middleware_stack(), self.state.settings.request_id_header_key, on_done, tracing)


def grpc_services() -> list[AddServices]:
    """The services of the gRPC port (`grpc_port`, lmiserve.server.grpc_server): the Open Inference
    Protocol's (imported only by a server that has the port)."""
    from lmiserve.protocols.tensor.kserve.grpc.servicer import add_to_server

    return [add_to_server]


def create_app(
    settings: Settings,
    service: ModelService | None = None,
    *,
    services: list[ModelService] | None = None,
    on_startup_load_failed: Callable[[ModelService], None] | None = None,
    on_engine_failed: Callable[[ModelService], None] | None = None,
    drain: Drain | None = None,
) -> Starlette:
    """One model (`service`, or one built from `settings`), or the models of a store (`services`).

    `on_startup_load_failed(service)` is called as soon as one of these startup models fails to load
    (`lmiserve serve` stops then: server/lifecycle.py); without it the server stays up, /ping 503.
    `on_engine_failed(service)`: one of them served, then its engine failed for good (the same).
    `drain`: the stopping server's drain state (lmiserve.server.drain; never active without it).
    """
    if services is None:
        services = [service or ModelService(settings)]
    if on_engine_failed is not None:
        for each in services:
            each.on_engine_failed.append(on_engine_failed)
    metrics = Metrics(lambda: registry)
    registry = ModelRegistry(services, observe=metrics.observer_for)
    tracing = Tracing.from_settings(settings)  # None when off: nothing of OpenTelemetry is imported

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with contextlib.AsyncExitStack() as stack:
            if tracing is not None:
                tracing.start()
                # after the engines stopped (the spans of the streams they ended), within a few seconds
                stack.push_async_callback(asyncio.to_thread, tracing.stop)
            if settings.metrics_port is not None:
                host, level, idle = settings.host, settings.log_level, settings.keep_alive_timeout
                await stack.enter_async_context(
                    metrics_port.serving(metrics.response, host, settings.metrics_port, level, idle)
                )
            loading = asyncio.create_task(registry.load_all(on_failed=on_startup_load_failed))
            lag = asyncio.create_task(metrics.loop_lag.watch())
            try:
                yield
            finally:
                lag.cancel()
                loading.cancel()
                await registry.close_all()

    # starlette types a handler as taking any Exception; each of these takes the class it is registered for
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _unexpected}
    app = LmiServeApp(routes=routes(settings, metrics), lifespan=lifespan, exception_handlers=handlers)
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.tracing = tracing
    app.state.settings = settings
    app.state.drain = drain or Drain()
    return app
