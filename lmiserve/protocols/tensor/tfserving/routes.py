"""TF Serving REST routes under /v1/models/...: one route, our own path parser (the `:predict` suffixes
and percent-encoded names do not fit starlette's path patterns).

`GET /v1/models` exactly is left to the OpenAI model list (the route table puts that first, so it wins
when both exist); every path below `/v1/models/` is TF Serving's. Errors are `{"error": msg}`,
4-space pretty (tfserving/errors.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import InvalidRequest, ModelNotFound
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.codecs.tfjson import parse_document
from lmiserve.protocols.tensor.tfserving import parse as tfserving
from lmiserve.protocols.tensor.tfserving import schema
from lmiserve.protocols.tensor.tfserving.errors import RENDERER
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes
from lmiserve.server.lookup import model_service
from lmiserve.server.responses import raw_response

_EXAMINED = ("signature_name", "instances", "inputs", "examples", "context", "parameters")  # other keys are ignored
CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "POST, GET",
    "Access-Control-Allow-Headers": "Content-Type",
}


def _raw_path(request: Request) -> str:
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if raw else request.url.path


async def handle(request: Request) -> Response:
    method = request.method
    if method == "OPTIONS":
        return _preflight(request)
    target = tfserving.parse_path(method, _raw_path(request))
    if method == "GET":
        return _status_or_metadata(request, target)
    return await _infer(request, target)


def _preflight(request: Request) -> Response:
    """CORS preflight: 200 with the CORS headers for an http(s) Origin, else 400."""
    if request.headers.get("origin", "").startswith(("http://", "https://")):
        return Response(status_code=200, headers=CORS)
    raise InvalidRequest("Origin header is missing in CORS preflight")


def _find(request: Request, target: tfserving.Target, not_found: str) -> ModelService:
    try:
        return model_service(request, target.name)
    except ModelNotFound:
        raise ModelNotFound(not_found) from None


def _status_or_metadata(request: Request, target: tfserving.Target) -> Response:
    svc = _find(request, target, f"Could not find any versions of model {target.name}")
    tfserving.check_status_version(target)
    if target.metadata:
        model = svc.tensor_model  # ModelNotReady (503) while loading
        return raw_response(tfserving.metadata_body(svc.name, model.signature, model.kind))
    state = {ModelService.READY: "AVAILABLE", ModelService.PENDING: "LOADING"}.get(svc.status, "END")
    return raw_response(tfserving.status_body(state, svc.error if state == "END" else None))


async def _infer(request: Request, target: tfserving.Target) -> Response:
    latest = f"Servable not found for request: Latest({target.name})"
    svc = _find(
        request,
        target,
        latest
        if target.version is None
        else f"Servable not found for request: Specific({target.name}, {target.version})",
    )
    tfserving.check_version(target)
    model = svc.tensor_model
    doc = parse_document(await request.body(), keep=_EXAMINED)
    if target.method == "predict":
        tensor_request, key = tfserving.parse_predict(doc, model.signature, svc.name)
        outputs = await model.infer(tensor_request)
        return raw_response(tfserving.predict_body(outputs, key))
    tensor_request = tfserving.parse_examples(doc, target.method or "", model.kind, model.signature)
    outputs = await model.infer(tensor_request)
    if target.method == "classify":
        labels = list(getattr(getattr(model, "runner", None), "labels", None) or [])
        return raw_response(tfserving.classify_body(outputs, labels))
    return raw_response(tfserving.regress_body(outputs))


TAG = "TF Serving"
_MODEL = "/v1/models/{model_name}"
_VERSION = "/v1/models/{model_name}/versions/{version}"


def _ops() -> list[apidoc.Operation]:
    """The concrete paths `handle` answers (the route's own pattern, `{rest:path}`, says nothing)."""
    out = []
    for base in (_MODEL, _VERSION):
        out += [
            apidoc.Operation(
                "Model status", TAG, apidoc.ok("Status", apidoc.json(schema.TfModelStatus)), method="GET", path=base
            ),
            apidoc.Operation(
                "Model metadata (the serving_default signature)",
                TAG,
                apidoc.ok("Metadata", apidoc.json(schema.TfModelMetadata)),
                method="GET",
                path=base + "/metadata",
            ),
            apidoc.Operation(
                "Predict (row or columnar format)",
                TAG,
                apidoc.ok("Predictions", apidoc.json(schema.TfPredictResponse)),
                body=apidoc.json(schema.TfPredictRequest),
                method="POST",
                path=base + ":predict",
            ),
        ]
        for verb, answer in (("classify", schema.TfClassifyResponse), ("regress", schema.TfRegressResponse)):
            out.append(
                apidoc.Operation(
                    f"{verb.capitalize()} tf.Example-style examples",
                    TAG,
                    apidoc.ok("Results", apidoc.json(answer)),
                    body=apidoc.json(schema.TfExamplesRequest),
                    method="POST",
                    path=f"{base}:{verb}",
                )
            )
    return out


def routes() -> list[BaseRoute]:
    """`/v1/models/...`, and `/v1/models` itself for what an earlier exact route (the OpenAI model list,
    `GET /v1/models`) does not take: TF Serving's 400 `Missing model name in request.` / `Malformed request`."""
    methods = ["GET", "POST", "OPTIONS", "PUT", "DELETE", "PATCH"]
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/v1/models/{rest:path}", handle, methods=methods), *_ops()),
            apidoc.hidden(Route("/v1/models", handle, methods=methods)),  # errors only (GET is OpenAI's)
        ],
    )
