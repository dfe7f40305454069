"""The starlette application: routes table, lifespan (model loads in the background), 404 shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lmiserve.config import Settings
from lmiserve.protocols.lmi.formatters import frontend_error_body
from lmiserve.protocols.lmi import routes as lmi_routes
from lmiserve.protocols.lmi import management
from lmiserve.protocols.openai import routes as openai_routes
from lmiserve.protocols.tensor import routes as tensor_routes
from lmiserve.protocols.tgi import routes as tgi_routes
from lmiserve.server.responses import raw_response
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService

log = logging.getLogger(__name__)

INFER = ["GET", "POST", "PUT", "OPTIONS"]  # LMI accepts any method on inference routes


def routes() -> list[Route]:
    return [
        Route("/ping", management.ping, methods=["GET", "POST"]),
        Route("/invocations", lmi_routes.invocations, methods=INFER),
        Route("/predictions/{model_name}", lmi_routes.invocations, methods=INFER),
        Route("/predictions/{model_name}/{version}", lmi_routes.invocations, methods=INFER),
        Route("/models/{model_name}/invoke", lmi_routes.invocations, methods=INFER),
        Route("/models", management.list_models, methods=["GET"]),
        Route("/models", management.register_model, methods=["POST"]),
        Route("/models/{model_name}", management.describe_model, methods=["GET"]),
        Route("/models/{model_name}", management.unregister_model, methods=["DELETE"]),
        Route("/models/{model_name}/{version}", management.describe_model, methods=["GET"]),
        Route("/models/{model_name}/{version}", management.unregister_model, methods=["DELETE"]),
        # TGI and OpenAI (README: TGI drop-in and OpenAI-compatible APIs)
        Route("/", tgi_routes.root, methods=["GET", "POST"]),
        Route("/generate", tgi_routes.generate, methods=["POST"]),
        Route("/generate_stream", tgi_routes.generate_stream, methods=["POST"]),
        Route("/tokenize", tgi_routes.tokenize, methods=["POST"]),
        Route("/chat_tokenize", tgi_routes.chat_tokenize, methods=["POST"]),
        Route("/health", tgi_routes.health, methods=["GET"]),
        Route("/info", tgi_routes.info, methods=["GET"]),
        Route("/v1/models", tgi_routes.models, methods=["GET"]),
        Route("/v1/chat/completions", openai_routes.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_routes.completions, methods=["POST"]),
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


def create_app(settings: Settings, service: ModelService | None = None, *, services: list[ModelService] | None = None) -> Starlette:
    """One model (`service`, or one built from `settings`), or the models of a store (`services`)."""
    if services is None:
        services = [service or ModelService(settings)]
    registry = ModelRegistry(services)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(registry.load_all())
        try:
            yield
        finally:
            loading.cancel()
            await registry.close_all()

    app = Starlette(routes=[*tensor_routes.configured_routes(settings), *routes(), *tensor_routes.routes()], lifespan=lifespan, exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    app.state.registry = registry
    app.state.settings = settings
    return app
