"""Vertex AI routes: predict and health on $AIP_PREDICT_ROUTE / $AIP_HEALTH_ROUTE (settings
vertex_predict_route / vertex_health_route), and always on the default shapes
`/v1/endpoints/{endpoint}/deployedModels/{model}:predict` and `.../deployedModels/{model}`.

The model is the server's default model (the LLM when several are loaded), or the `model_name` query
parameter (an lmiserve extension for multi-model servers). Health is 200 `{}` once every model is
ready, else 503. Errors are JSON `{"error": msg}` (vertex/errors.py).
"""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import ModelNotReady, NotFound
from lmiserve.protocols.tensor.vertex import parse as vertex
from lmiserve.protocols.tensor.vertex import schema
from lmiserve.protocols.tensor.vertex.errors import RENDERER
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response


def _deployed_id(request: Request) -> str:
    settings = getattr(request.app.state, "settings", None)
    return getattr(settings, "vertex_deployed_model_id", None) or ""


async def predict(request: Request) -> Response:
    svc = lookup.model_service(request, request.query_params.get("model_name"))
    model = svc.tensor_model
    tensor_request, count = vertex.parse(await request.body(), model.signature, svc.name)
    outputs = await model.infer(tensor_request)
    return raw_response(vertex.response(outputs, count, _deployed_id(request)))


async def health(request: Request) -> Response:
    if not lookup.all_ready(request):
        raise ModelNotReady("Model is not ready.")
    return raw_response(b"{}")


async def deployed_predict(request: Request) -> Response:
    """POST `.../deployedModels/{model}:predict`."""
    if not request.path_params["deployed"].endswith(":predict"):
        raise NotFound(f"Not Found: {request.method} {request.url.path}")
    return await predict(request)


async def deployed_health(request: Request) -> Response:
    """GET `.../deployedModels/{model}`: health."""
    if ":" in request.path_params["deployed"]:
        raise NotFound(f"Not Found: {request.method} {request.url.path}")
    return await health(request)


TAG = "Vertex AI"
PREDICT = apidoc.Operation(
    "Predict (Vertex AI's custom container contract)",
    TAG,
    apidoc.ok("Predictions", apidoc.json(schema.VertexPredictResponse)),
    body=apidoc.json(schema.VertexPredictRequest),
    params=[apidoc.Param("model_name", "The model (default: the served model)")],
)
HEALTH = apidoc.Operation(
    "Health: `{}` once every model is ready", TAG, apidoc.ok("Ready", apidoc.json({"type": "object"}))
)


def configured_routes(settings) -> list[BaseRoute]:
    """The $AIP_* routes: placed before every other route, since the platform chose these paths
    (AIP_HEALTH_ROUTE=/health must answer Vertex's health, not TGI's)."""
    predict_route = settings.vertex_predict_route
    health_route = settings.vertex_health_route
    return protocol_routes(
        RENDERER,
        [apidoc.document(Route(predict_route, predict, methods=["POST"]), PREDICT)] if predict_route else [],
        public=[apidoc.document(Route(health_route, health, methods=["GET"]), HEALTH)] if health_route else [],
    )


_DEPLOYED = "/v1/endpoints/{endpoint}/deployedModels/{deployed}"


def _deployed(op: apidoc.Operation, suffix: str) -> apidoc.Operation:
    return dataclasses.replace(op, path="/v1/endpoints/{endpoint}/deployedModels/{deployed_model}" + suffix)


def routes() -> list[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [apidoc.document(Route(_DEPLOYED, deployed_predict, methods=["POST"]), _deployed(PREDICT, ":predict"))],
        public=[apidoc.document(Route(_DEPLOYED, deployed_health, methods=["GET"]), _deployed(HEALTH, ""))],
    )
