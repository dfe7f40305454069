"""LMI inference routes: POST /invocations, /predictions/{model}, /models/{model}/invoke."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.lmi import tensor as lmi_tensor
from lmiserve.core.errors import LmiServeError
from lmiserve.protocols.lmi.formatters import DynamicBatchFormatter, DynamicBatchStreamFormatter, get_formatter
from lmiserve.protocols.openai import routes as openai_routes
from lmiserve.protocols.tensor.sagemaker import routes as sagemaker
from lmiserve.server.responses import error_response, raw_response, respond_events
from lmiserve.models.service import ModelService, model_service
from lmiserve.core.aio import merge_tagged
from starlette.routing import Route

from lmiserve.protocols.lmi import management


def _service_for(request: Request) -> ModelService:
    name = (
        request.path_params.get("model_name")
        or request.query_params.get("model_name")
        or request.headers.get("model_name")
    )
    return model_service(request, name)


async def invocations(request: Request) -> Response:
    if request.method == "OPTIONS":
        return raw_response(b"{}")
    routed = await openai_routes.dispatch_invocation(request)  # API key; chat/completion/TGI bodies
    if routed is not None:
        return routed
    answered = await sagemaker.handle(request)
    if answered is not None:  # SageMaker content types and non-LLM models (protocols/tensor/sagemaker/routes.py)
        return answered
    service = None
    try:
        service = _service_for(request)
        engine = service.ready_engine()
        payload = lmi.decode_body(await request.body(), request.headers.get("content-type"))
        if not service.is_llm:
            return await tensor_invocation(service, payload)
        call = lmi.parse(payload, service.limits, dynamic_batch=service.dynamic_batching)
        if service.dynamic_batching:
            return await _dynamic_batch(request, engine, call, service)
        fmt = get_formatter(call.formatter, call.options)
        return await respond_events(request, engine.generate(call.requests[0]), fmt)
    except LmiServeError as exc:
        return error_response(exc, service.name if service else "")


async def _dynamic_batch(request: Request, engine, call: lmi.LmiCall, service: ModelService) -> Response:
    """rolling_batch=disable: each input is a request of one static batch; LMI's list schema."""
    events: AsyncIterator = merge_tagged([engine.generate(r) for r in call.requests])
    if call.stream and service.settings.enable_streaming:
        fmt = DynamicBatchStreamFormatter(len(call.requests))
    else:
        fmt = DynamicBatchFormatter([r.prompt for r in call.requests], return_full_text=call.options.return_full_text)
    return await respond_events(request, events, fmt, on_event=lambda item: fmt.on_event(*item))


async def tensor_invocation(service: ModelService, payload) -> Response:
    """A one-shot model (embedding, classifier, TorchScript) on LMI's routes: JSON in, JSON out."""
    model = service.tensor_model
    outputs = await model.infer(lmi_tensor.to_tensor_request(payload, model))
    return raw_response(json.dumps(lmi_tensor.to_json(model.kind, outputs), ensure_ascii=False).encode())


INFER = ["GET", "POST", "PUT", "OPTIONS"]  # LMI accepts any method on inference routes


def routes() -> list[Route]:
    return [
        Route("/ping", management.ping, methods=["GET", "POST"]),
        Route("/invocations", invocations, methods=INFER),
        Route("/predictions/{model_name}", invocations, methods=INFER),
        Route("/predictions/{model_name}/{version}", invocations, methods=INFER),
        Route("/models/{model_name}/invoke", invocations, methods=INFER),
        Route("/models", management.list_models, methods=["GET"]),
        Route("/models", management.register_model, methods=["POST"]),
        Route("/models/{model_name}", management.describe_model, methods=["GET"]),
        Route("/models/{model_name}", management.unregister_model, methods=["DELETE"]),
        Route("/models/{model_name}/{version}", management.describe_model, methods=["GET"]),
        Route("/models/{model_name}/{version}", management.unregister_model, methods=["DELETE"]),
    ]
