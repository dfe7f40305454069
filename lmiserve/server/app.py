"""The starlette application: routes table, lifespan (model loads in the background), 404 shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
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
from lmiserve.server import invocations
from lmiserve.server.drain import Drain
from lmiserve.server.responses import raw_response

log = logging.getLogger(__name__)


def routes(settings: Settings) -> list[BaseRoute]:
    """The route table; the first match wins, so Vertex AI's configured paths come first and the exact
    LMI, TGI and OpenAI routes before the tensor protocols' patterns."""
    return [
        *tensor.configured_routes(settings),
        *lmi.ping_routes(),
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
    settings: Settings,
    service: ModelService | None = None,
    *,
    services: list[ModelService] | None = None,
    on_startup_load_failed: Callable[[ModelService], None] | None = None,
    drain: Drain | None = None,
) -> Starlette:
    """One model (`service`, or one built from `settings`), or the models of a store (`services`).

    `on_startup_load_failed(service)` is called as soon as one of these startup models fails to load
    (`lmiserve serve` stops then: server/lifecycle.py); without it the server stays up, /ping 503.
    `drain`: the stopping server's drain state (lmiserve.server.drain; never active without it).
    """
    if services is None:
        services = [service or ModelService(settings)]
    registry = ModelRegistry(services)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(registry.load_all(on_failed=on_startup_load_failed))
        try:
            yield
        finally:
            loading.cancel()
            await registry.close_all()

    # starlette types a handler as taking any Exception; each of these takes the class it is registered for
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _unexpected}
    app = Starlette(routes=routes(settings), lifespan=lifespan, exception_handlers=handlers)
    app.state.registry = registry
    app.state.settings = settings
    app.state.drain = drain or Drain()
    return app
