"""LMI's inference handlers and its route table (health and management).

The inference routes (/invocations, /predictions/{m}[/{v}], /models/{m}/invoke) are decoded by
`lmiserve.server.invocations`, which calls a handler here with the addressed model and the decoded
payload; errors are raised and answered by `lmiserve.protocols.lmi.errors` (LmiErrors).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.config import Settings
from lmiserve.core.aio import merge_tagged
from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi import management
from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.lmi import tensor as lmi_tensor
from lmiserve.protocols.lmi.errors import MANAGEMENT, RENDERER
from lmiserve.protocols.lmi.formatters import (
    DynamicBatchFormatter,
    DynamicBatchStreamFormatter,
    get_formatter,
)
from lmiserve.server.errors import protocol_routes
from lmiserve.server.pipeline import respond, tagged
from lmiserve.server.responses import raw_response


async def rolling(request: Request, service: ModelService, payload: Any) -> Response:
    """A text-generation request on the continuous batch, answered by its output formatter."""
    engine = service.ready_generator()
    call = lmi.parse(payload, service.limits)
    encoder = get_formatter(call.formatter, call.options)
    return await respond(request, tagged(engine.generate(call.requests[0])), encoder)


async def dynamic_batch(request: Request, service: ModelService, payload: Any) -> Response:
    """rolling_batch=disable: each input is a request of one static batch; LMI's list schema."""
    engine = service.ready_generator()
    call = lmi.parse(payload, service.limits, dynamic_batch=True)
    events = merge_tagged([engine.generate(r) for r in call.requests])
    if call.stream and service.settings.enable_streaming:
        encoder: DynamicBatchFormatter | DynamicBatchStreamFormatter = DynamicBatchStreamFormatter(len(call.requests))
    else:
        encoder = DynamicBatchFormatter(
            [r.prompt for r in call.requests], return_full_text=call.options.return_full_text
        )
    return await respond(request, events, encoder)


async def one_shot(request: Request, service: ModelService, payload: Any) -> Response:
    """A one-shot model (embedding, classifier, TorchScript) on LMI's routes: JSON in, JSON out."""
    model = service.tensor_model
    outputs = await model.infer(lmi_tensor.to_tensor_request(payload, model))
    return raw_response(json.dumps(lmi_tensor.to_json(model.kind, outputs), ensure_ascii=False).encode())


def ping_routes() -> list[BaseRoute]:
    """Health; first in the table (the inference routes follow it, then `routes()`)."""
    return protocol_routes(RENDERER, [], public=[Route("/ping", management.ping, methods=["GET", "POST"])])


def routes(settings: Settings) -> list[BaseRoute]:
    """The management API, unless `enable_management_api` is off."""
    if not settings.enable_management_api:
        return []
    return protocol_routes(
        MANAGEMENT,
        [
            Route("/models", management.list_models, methods=["GET"]),
            Route("/models", management.register_model, methods=["POST"]),
            Route("/models/{model_name}", management.describe_model, methods=["GET"]),
            Route("/models/{model_name}", management.unregister_model, methods=["DELETE"]),
            Route("/models/{model_name}/{version}", management.describe_model, methods=["GET"]),
            Route("/models/{model_name}/{version}", management.unregister_model, methods=["DELETE"]),
        ],
    )
