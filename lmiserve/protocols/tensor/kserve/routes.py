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
from lmiserve.protocols.tensor.errors import TensorError, error_json
from lmiserve.protocols.tensor.kserve import infer as inference
from lmiserve.protocols.tensor.kserve import parse as kserve
from lmiserve.protocols.tensor.kserve import schema
from lmiserve.protocols.tensor.kserve.errors import READINESS, RENDERER
from lmiserve.protocols.tensor.kserve.generate import generate, generate_stream
from lmiserve.protocols.tensor.kserve.models import check_ready, ready_model, resolve
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response

EXTENSIONS = ["binary_tensor_data", "parameters", "generate"]
LIVE_BODY = b'{"live": true}'
READY_BODY = b'{"ready": true}'
ANY = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]


async def server_metadata(request: Request) -> Response:
    body = {"name": "lmiserve", "version": lmiserve.__version__, "extensions": EXTENSIONS}
    return raw_response(json.dumps(body).encode())


async def live(request: Request) -> Response:
    """`{"live": true}` (the Open Inference Protocol's `$live_server_response`); a draining server too."""
    return raw_response(LIVE_BODY)


async def ready(request: Request) -> Response:
    """`{"ready": true}` once every model is ready, else 503 `{"error": ..., "ready": false}`."""
    if not lookup.all_ready(request):
        raise ModelNotReady("Server is not ready.")
    return raw_response(READY_BODY)


async def model_ready(request: Request) -> Response:
    """`{"name": m, "ready": true}` (`$ready_model_response`), else 503 `{"error": ..., "ready": false}`;
    an unknown model or version 404 `{"error": ...}`."""
    svc = resolve(request)
    check_ready(svc)
    return raw_response(json.dumps({"name": svc.name, "ready": True}, ensure_ascii=False).encode("utf-8"))


async def model_metadata(request: Request) -> Response:
    svc, model = ready_model(request)
    return raw_response(json.dumps(kserve.metadata(svc.name, model.kind, model.signature)).encode())


async def infer(request: Request) -> Response:
    svc, model = ready_model(request)
    body = binary.decompress(await request.body(), request.headers.get("content-encoding"))
    header, tail = binary.split_body(body, request.headers.get(binary.HEADER))
    outputs, plan = await inference.infer(kserve.load_header(header), tail, svc.name, model, "/infer")
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
    for route in [*_LIVE, *_READY, *_ROUTES]:
        if route.matches(request.scope)[0] == Match.PARTIAL:  # the path exists, the method does not
            return raw_response(error_json("Method Not Allowed"), 405)
    raise NotFound(f"Not Found: {request.method} {request.url.path}")


TAG = "KServe V2"
BINARY = "application/octet-stream"
_BINARY_NOTE = "Triton's binary extension: the JSON header (Inference-Header-Content-Length bytes), then raw tensors"


def _op(summary: str, replies: dict, body: dict | None = None) -> apidoc.Operation:
    return apidoc.Operation(summary, TAG, replies, body=body)


METADATA = _op(
    "Model metadata: its input and output tensors", apidoc.ok("Metadata", apidoc.json(schema.V2ModelMetadata))
)
INFER = _op(
    "Inference on tensors (JSON, or Triton's binary tensor data)",
    apidoc.ok(
        "The output tensors",
        {apidoc.JSON: schema.V2InferResponse, BINARY: {"type": "string", "description": _BINARY_NOTE}},
    ),
    {apidoc.JSON: schema.V2InferRequest, BINARY: {"type": "string", "description": _BINARY_NOTE}},
)
GENERATE = _op(
    "Generate text (Triton's generate extension)",
    apidoc.ok("The text", apidoc.json(schema.V2GenerateResponse)),
    apidoc.json(schema.V2GenerateRequest),
)
GENERATE_STREAM = _op(
    "Generate text, streamed (Triton's generate extension)",
    apidoc.ok(
        "Server-sent events",
        apidoc.sse(
            'One event per piece of text; a failure after the start is a last `{"error"}` event',
            schema.V2GenerateResponse,
            TensorError,
        ),
    ),
    apidoc.json(schema.V2GenerateRequest),
)
SERVER_READY = _op(
    "Readiness of the server: 200 once every model is ready (503 before, and while it drains)",
    apidoc.ok("Ready", apidoc.json(schema.ServerReady)),
)
MODEL_READY = _op(
    "Readiness of one model: 200 once it is ready (503 before, and while the server drains)",
    apidoc.ok("Ready", apidoc.json(schema.ModelReady)),
)


def _model_routes(prefix: str) -> list[BaseRoute]:
    return [
        apidoc.document(Route(prefix, model_metadata, methods=["GET"]), METADATA),
        apidoc.document(Route(prefix + "/infer", infer, methods=["POST"]), INFER),
        apidoc.document(Route(prefix + "/generate", generate, methods=["POST"]), GENERATE),
        apidoc.document(Route(prefix + "/generate_stream", generate_stream, methods=["POST"]), GENERATE_STREAM),
    ]


SERVER = _op("Server metadata", apidoc.ok("Metadata", apidoc.json(schema.ServerMetadata)))

# Health and readiness (no API key): registered with their full paths before the /v2 mount; liveness
# answers 200 as long as the process serves (a draining server included), readiness 503 once it drains.
_LIVE = [
    apidoc.document(
        Route("/health/live", live, methods=["GET"]),
        _op(
            "Liveness: 200 while the process serves (a draining server too)",
            apidoc.ok("Live", apidoc.json(schema.ServerLive)),
        ),
    ),
]
_READY = [
    apidoc.document(Route("/health/ready", ready, methods=["GET"]), SERVER_READY),
    apidoc.document(Route("/models/{model}/ready", model_ready, methods=["GET"]), MODEL_READY),
    apidoc.document(Route("/models/{model}/versions/{version}/ready", model_ready, methods=["GET"]), MODEL_READY),
]
_ROUTES = [
    apidoc.document(Route("/", server_metadata, methods=["GET"]), SERVER),
    apidoc.document(
        Route("/repository/index", repository_index, methods=["POST"]),
        apidoc.Operation(
            "Triton's repository index: every model and its state",
            TAG,
            apidoc.ok("The models", apidoc.json(list[schema.IndexEntry])),
            body=apidoc.json(schema.IndexRequest),
            body_required=False,
        ),
    ),
    *_model_routes("/models/{model}"),
    *_model_routes("/models/{model}/versions/{version}"),
]


def routes() -> list[BaseRoute]:
    """Everything under /v2, with JSON 404/405 answers for unknown paths and methods."""
    return [
        *protocol_routes(RENDERER, [], live=_under_v2(_LIVE)),
        *protocol_routes(READINESS, [], public=_under_v2(_READY)),
        *protocol_routes(
            RENDERER,
            [
                apidoc.document(Route("/v2", server_metadata, methods=["GET"]), SERVER),
                Mount("/v2", routes=[*_ROUTES, apidoc.hidden(Route("/{path:path}", not_found, methods=ANY))]),
            ],
        ),
    ]


def _under_v2(probes: list[BaseRoute]) -> list[BaseRoute]:
    """`probes` registered with their full /v2 paths, keeping their API document entries."""
    return [
        apidoc.document(Route("/v2" + r.path, r.endpoint, methods=r.methods), *getattr(r, apidoc.ATTRIBUTE))
        for r in probes
        if isinstance(r, Route)
    ]
