"""KServe V2 / Open Inference Protocol routes under /v2: health, server and model metadata, infer
(JSON and Triton's binary extension), Triton's repository index and generate extension (generate.py).
Every error answer is JSON `{"error": msg}` (kserve/errors.py), unknown paths and methods under /v2
included."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route

import lmiserve
from lmiserve.core.errors import ModelNotReady, NotFound
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.codecs import binary
from lmiserve.protocols.tensor.errors import error_json
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve.errors import RENDERER
from lmiserve.protocols.tensor.kserve.generate import generate, generate_stream
from lmiserve.protocols.tensor.kserve.models import check_ready, ready_model, resolve
from lmiserve.server import lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response

EXTENSIONS = ["binary_tensor_data", "parameters", "generate"]
ANY = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]


async def server_metadata(request: Request) -> Response:
    body = {"name": "lmiserve", "version": lmiserve.__version__, "extensions": EXTENSIONS}
    return raw_response(json.dumps(body).encode())


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    if not lookup.all_ready(request):
        raise ModelNotReady("Server is not ready.")
    return Response(status_code=200)


async def model_ready(request: Request) -> Response:
    check_ready(resolve(request))
    return Response(status_code=200)


async def model_metadata(request: Request) -> Response:
    svc, model = ready_model(request)
    return raw_response(json.dumps(kserve.metadata(svc.name, model.kind, model.signature)).encode())


async def infer(request: Request) -> Response:
    svc, model = ready_model(request)
    body = binary.decompress(await request.body(), request.headers.get("content-encoding"))
    header, tail = binary.split_body(body, request.headers.get(binary.HEADER))
    tensor_request, plan = kserve.parse_infer(kserve.load_header(header), tail, svc.name, model.signature)
    outputs = await model.infer(tensor_request)
    body, headers, content_type = kserve.encode_response(outputs, plan, svc.name)
    return raw_response(body, 200, content_type, headers)


async def repository_index(request: Request) -> Response:
    """Triton's repository index: every model with its state; `{"ready": true}` keeps the READY ones."""
    only_ready = kserve.index_ready_only(await request.body())
    states = {ModelService.READY: "READY", ModelService.PENDING: "LOADING"}
    index = []
    for svc in lookup.services(request):
        state = states.get(svc.status, "UNAVAILABLE")
        if not only_ready or state == "READY":
            index.append({"name": svc.name, "version": kserve.VERSION, "state": state, "reason": svc.error or ""})
    return raw_response(json.dumps(index).encode())


async def not_found(request: Request) -> Response:
    """Any other path or method under /v2 (Triton answers a known path with a wrong method 405)."""
    for route in [*_PROBES, *_ROUTES]:
        if route.matches(request.scope)[0] == Match.PARTIAL:  # the path exists, the method does not
            return raw_response(error_json("Method Not Allowed"), 405)
    raise NotFound(f"Not Found: {request.method} {request.url.path}")


def _model_routes(prefix: str) -> list[Route]:
    return [
        Route(prefix, model_metadata, methods=["GET"]),
        Route(prefix + "/infer", infer, methods=["POST"]),
        Route(prefix + "/generate", generate, methods=["POST"]),
        Route(prefix + "/generate_stream", generate_stream, methods=["POST"]),
    ]


# Health and readiness (no API key): registered with their full paths before the /v2 mount; liveness
# answers 200 as long as the process serves (a draining server included), readiness 503 once it drains.
_LIVE = [Route("/health/live", live, methods=["GET"])]
_READY = [
    Route("/health/ready", ready, methods=["GET"]),
    Route("/models/{model}/ready", model_ready, methods=["GET"]),
    Route("/models/{model}/versions/{version}/ready", model_ready, methods=["GET"]),
]
_PROBES = [*_LIVE, *_READY]
_ROUTES = [
    Route("/", server_metadata, methods=["GET"]),
    Route("/repository/index", repository_index, methods=["POST"]),
    *_model_routes("/models/{model}"),
    *_model_routes("/models/{model}/versions/{version}"),
]


def routes() -> list[BaseRoute]:
    """Everything under /v2, with JSON 404/405 answers for unknown paths and methods."""
    return protocol_routes(
        RENDERER,
        [
            Route("/v2", server_metadata, methods=["GET"]),
            Mount("/v2", routes=[*_ROUTES, Route("/{path:path}", not_found, methods=ANY)]),
        ],
        live=[Route("/v2" + r.path, r.endpoint, methods=r.methods) for r in _LIVE],
        public=[Route("/v2" + r.path, r.endpoint, methods=r.methods) for r in _READY],
    )
