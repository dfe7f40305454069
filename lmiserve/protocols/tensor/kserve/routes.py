"""KServe V2 / Open Inference Protocol routes under /v2 (reference §3): health, metadata, infer (JSON and
binary), and Triton's generate extension for LLMs. Every non-200 answer is JSON `{"error": msg}`."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount, Route

import lmiserve
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.codecs import binary
from lmiserve.protocols.tensor.codecs.errors import TensorError, protocol_status
from lmiserve.core.errors import LmiServeError, ModelNotFound
from lmiserve.server import lookup as tensor_lookup
from lmiserve.server.responses import raw_response
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve.generate import generate, generate_stream

EXTENSIONS = ["binary_tensor_data", "parameters", "generate"]
ANY = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]


def error(message: str, status: int) -> Response:
    return raw_response(json.dumps({"error": message}, ensure_ascii=False).encode("utf-8"), status)


def fail(exc: LmiServeError) -> Response:
    return error(exc.message, protocol_status(exc))


async def server_metadata(request: Request) -> Response:
    body = {"name": "lmiserve", "version": lmiserve.__version__, "extensions": EXTENSIONS}
    return raw_response(json.dumps(body).encode())


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    if tensor_lookup.all_ready(request):
        return Response(status_code=200)
    return error("Server is not ready.", 503)


def resolve(request: Request):
    """The addressed model's service; 404 (MLServer's words) for an unknown name or version."""
    name = request.path_params["model"]
    try:
        svc = tensor_lookup.service(request, name)
    except ModelNotFound:
        raise TensorError(f"Model {name} not found", status=404) from None
    version = request.path_params.get("version")
    if version is not None and version != kserve.VERSION:
        raise TensorError(f"Model {name} with version {version} not found", status=404)
    return svc


def ready_model(request: Request):
    """(service, TensorModel) of the addressed model; 503 `Model <m> is not ready yet.` while it loads."""
    svc = resolve(request)
    if not tensor_lookup.is_ready(svc):
        raise TensorError(f"Model {svc.name} is not ready yet.", status=503)
    return svc, svc.tensor_model


async def model_ready(request: Request) -> Response:
    try:
        svc = resolve(request)
    except LmiServeError as exc:
        return fail(exc)
    if tensor_lookup.is_ready(svc):
        return Response(status_code=200)
    return error(f"Model {svc.name} is not ready yet.", 503)


async def model_metadata(request: Request) -> Response:
    try:
        svc, model = ready_model(request)
    except LmiServeError as exc:
        return fail(exc)
    return raw_response(json.dumps(kserve.metadata(svc.name, model.kind, model.signature)).encode())


async def infer(request: Request) -> Response:
    try:
        svc, model = ready_model(request)
        body = binary.decompress(await request.body(), request.headers.get("content-encoding"))
        header, tail = binary.split_body(body, request.headers.get(binary.HEADER))
        tensor_request, plan = kserve.parse_infer(kserve.load_header(header), tail, svc.name, model.signature)
        outputs = await model.infer(tensor_request)
        body, headers, content_type = kserve.encode_response(outputs, plan, svc.name)
    except LmiServeError as exc:
        return fail(exc)
    return raw_response(body, 200, content_type, headers)


async def repository_index(request: Request) -> Response:
    """Triton's repository index: every model with its state; `{"ready": true}` keeps the READY ones."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return error("failed to parse the request JSON", 400)
    only_ready = isinstance(body, dict) and body.get("ready") is True
    states = {ModelService.READY: "READY", ModelService.PENDING: "LOADING"}
    index = []
    for svc in tensor_lookup.services(request):
        state = states.get(svc.status, "UNAVAILABLE")
        if not only_ready or state == "READY":
            index.append({"name": svc.name, "version": kserve.VERSION, "state": state, "reason": svc.error or ""})
    return raw_response(json.dumps(index).encode())


async def not_found(request: Request) -> Response:
    for route in _ROUTES:
        if route.matches(request.scope)[0] == Match.PARTIAL:  # the path exists, the method does not
            return error("Method Not Allowed", 405)
    return error(f"Not Found: {request.method} {request.url.path}", 404)


def _model_routes(prefix: str) -> list[Route]:
    return [
        Route(prefix, model_metadata, methods=["GET"]),
        Route(prefix + "/ready", model_ready, methods=["GET"]),
        Route(prefix + "/infer", infer, methods=["POST"]),
        Route(prefix + "/generate", generate, methods=["POST"]),
        Route(prefix + "/generate_stream", generate_stream, methods=["POST"]),
    ]


_ROUTES = [
    Route("/", server_metadata, methods=["GET"]),
    Route("/health/live", live, methods=["GET"]),
    Route("/health/ready", ready, methods=["GET"]),
    Route("/repository/index", repository_index, methods=["POST"]),
    *_model_routes("/models/{model}"),
    *_model_routes("/models/{model}/versions/{version}"),
]


def routes() -> list:
    """Everything under /v2, with JSON 404/405 answers for unknown paths and methods."""
    return [
        Route("/v2", server_metadata, methods=["GET"]),
        Mount("/v2", routes=[*_ROUTES, Route("/{path:path}", not_found, methods=ANY)]),
    ]
