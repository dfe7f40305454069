"""The starlette application: routes table, lifespan (model loads in the background), 404 shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from lmiserve.config import Settings
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi import routes as lmi
from lmiserve.protocols.lmi.errors import frontend_error_body
from lmiserve.protocols.openai import routes as openai
from lmiserve.protocols.tensor import routes as tensor
from lmiserve.protocols.tgi import routes as tgi
from lmiserve.server import invocations, playground
from lmiserve.server.metrics import Metrics, RequestMetrics
from lmiserve.server.metrics import port as metrics_port
from lmiserve.server.responses import raw_response

log = logging.getLogger(__name__)


def routes(settings: Settings, metrics: Metrics) -> list[BaseRoute]:
    """The route table; the first match wins, so Vertex AI's configured paths come first and the exact
    LMI, TGI and OpenAI routes before the tensor protocols' patterns."""
    return [
        *tensor.configured_routes(settings),
        *lmi.ping_routes(),
        *metrics.routes(),
        *playground.routes(),
        *invocations.routes(),
        *lmi.routes(settings),
        *tgi.routes(),
        *openai.routes(),
        *tensor.routes(),
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


def create_app(
    settings: Settings, service: ModelService | None = None, *, services: list[ModelService] | None = None
) -> Starlette:
    """One model (`service`, or one built from `settings`), or the models of a store (`services`)."""
    if services is None:
        services = [service or ModelService(settings)]
    metrics = Metrics(lambda: registry)
    registry = ModelRegistry(services, observe=metrics.observer_for)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with contextlib.AsyncExitStack() as stack:
            if settings.metrics_port is not None:
                host, level = settings.host, settings.log_level
                await stack.enter_async_context(
                    metrics_port.serving(metrics.response, host, settings.metrics_port, level)
                )
            loading = asyncio.create_task(registry.load_all())
            try:
                yield
            finally:
                loading.cancel()
                await registry.close_all()

    # starlette types a handler as taking any Exception; each of these takes the class it is registered for
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _unexpected}
    app = Starlette(
        routes=routes(settings, metrics),
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[Middleware(RequestMetrics, collectors=metrics.requests)],
    )
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.settings = settings
    return app
