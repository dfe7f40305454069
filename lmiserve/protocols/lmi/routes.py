"""LMI's inference handlers and its route table (health and management).

The inference routes (/invocations, /predictions/{m}[/{v}], /models/{m}/invoke) are decoded by
`lmiserve.protocols.invocations`, which calls a handler here with the addressed model, the decoded
payload and where the request names a LoRA adapter outside its body; errors are raised and answered by
`lmiserve.protocols.lmi.errors` (LmiErrors).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.config import Settings
from lmiserve.core.adapters import NOWHERE, Elsewhere
from lmiserve.core.aio import merge_tagged
from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi import adapters, management, schema
from lmiserve.protocols.lmi import parse as lmi
from lmiserve.protocols.lmi import tensor as lmi_tensor
from lmiserve.protocols.lmi.errors import MANAGEMENT, RENDERER
from lmiserve.protocols.lmi.formatters import (
    DynamicBatchFormatter,
    DynamicBatchStreamFormatter,
    get_formatter,
)
from lmiserve.server import apidoc
from lmiserve.server.apidoc import Reply
from lmiserve.server.errors import protocol_routes
from lmiserve.server.pipeline import respond, tagged
from lmiserve.server.responses import raw_response


async def rolling(request: Request, service: ModelService, payload: Any, elsewhere: Elsewhere = NOWHERE) -> Response:
    """A text-generation request on the continuous batch, answered by its output formatter."""
    engine = service.ready_generator()
    call = lmi.parse(payload, service.limits, **_adapter_args(service, elsewhere))
    encoder = get_formatter(call.formatter, call.options)
    return await respond(request, tagged(engine.generate(call.requests[0])), encoder)


async def dynamic_batch(
    request: Request, service: ModelService, payload: Any, elsewhere: Elsewhere = NOWHERE
) -> Response:
    """rolling_batch=disable: each input is a request of one static batch; LMI's list schema."""
    engine = service.ready_generator()
    call = lmi.parse(payload, service.limits, dynamic_batch=True, **_adapter_args(service, elsewhere))
    events = merge_tagged([engine.generate(r) for r in call.requests])
    if call.stream and service.settings.enable_streaming:
        encoder: DynamicBatchFormatter | DynamicBatchStreamFormatter = DynamicBatchStreamFormatter(len(call.requests))
    else:
        encoder = DynamicBatchFormatter(
            [r.prompt for r in call.requests], return_full_text=call.options.return_full_text
        )
    return await respond(request, events, encoder)


def _adapter_args(service: ModelService, elsewhere: Elsewhere) -> dict[str, Any]:
    """What `lmi.parse` needs to pick each input's LoRA adapter: the model's names and adapters, and
    where the request names one outside its body (the query parameter, SageMaker's header)."""
    return {"names": lmi.model_names(service), "adapters": service.adapters, "elsewhere": elsewhere}


async def one_shot(request: Request, service: ModelService, payload: Any, elsewhere: Elsewhere = NOWHERE) -> Response:
    """A one-shot model (embedding, classifier, TorchScript) on LMI's routes: JSON in, JSON out."""
    model = service.tensor_model
    outputs = await model.infer(lmi_tensor.to_tensor_request(payload, model))
    return raw_response(json.dumps(lmi_tensor.to_json(model.kind, outputs), ensure_ascii=False).encode())


TAG = "LMI management"
_PING = {
    status: Reply(text, apidoc.json(schema.Ping))
    for status, text in ((200, "Every model is healthy"), (503, "A model is loading or failed"))
}
PING = [apidoc.Operation("Health of every model", "LMI", _PING, method=m) for m in ("GET", "POST")]
_INT = {"type": "integer", "minimum": 0}
LIST = apidoc.Operation(
    "The registered models, a page at a time",
    TAG,
    apidoc.ok("A page of models", apidoc.json(schema.ModelPage)),
    params=[
        apidoc.Param("limit", "Models per page (1 to 100)", _INT),
        apidoc.Param("next_page_token", "The first model of the page", _INT),
    ],
)
REGISTER = apidoc.Operation(
    "Register and load a model from a directory under model_store / allowed_model_paths",
    TAG,
    {
        200: Reply("Registered", apidoc.json(schema.StatusMessage)),
        202: Reply("Registration scheduled (synchronous=false)", apidoc.json(schema.StatusMessage)),
    },
    body=apidoc.json(schema.Registration),
    body_required=False,
    params=[
        apidoc.Param("url", "A model directory or file (a path or a file: URL)"),
        apidoc.Param("model_name", "The name to serve it under (default: the directory's)"),
        apidoc.Param("synchronous", "false: answer 202 at once and load in the background"),
        *(apidoc.Param(name, "A model setting") for name in management.SETTING_PARAMS),
    ],
)
DESCRIBE = apidoc.Operation("Describe a model", TAG, apidoc.ok("The model", apidoc.json(list[schema.Workflow])))
UNREGISTER = apidoc.Operation(
    "Stop a model and forget it", TAG, apidoc.ok("Unregistered", apidoc.json(schema.StatusMessage))
)
ADAPTERS_TAG = "LMI adapters"
_STATUS = apidoc.json(schema.StatusMessage)
LIST_ADAPTERS = apidoc.Operation(
    "The model's LoRA adapters, a page at a time",
    ADAPTERS_TAG,
    apidoc.ok("A page of adapters", apidoc.json(schema.AdapterPage)),
    params=[
        apidoc.Param("limit", "Adapters per page (1 to 100)", _INT),
        apidoc.Param("next_page_token", "The first adapter of the page", _INT),
    ],
)
_BOOL = {"type": "boolean"}
REGISTER_ADAPTER = apidoc.Operation(
    "Register a LoRA adapter from a folder under model_store / allowed_model_paths",
    ADAPTERS_TAG,
    apidoc.ok("Registered", _STATUS),
    body=apidoc.json(schema.AdapterRegistration),
    body_required=False,
    params=[
        apidoc.Param("name", "The adapter's name"),
        apidoc.Param("src", "A PEFT LoRA adapter folder (a path or a file: URL)"),
        apidoc.Param("preload", "Load its weights now (default true)", _BOOL),
        apidoc.Param("pin", "Keep it in memory (default false)", _BOOL),
    ],
)
DESCRIBE_ADAPTER = apidoc.Operation(
    "Describe a LoRA adapter", ADAPTERS_TAG, apidoc.ok("The adapter", apidoc.json(schema.AdapterDescription))
)
UPDATE_ADAPTER = apidoc.Operation(
    "Load a LoRA adapter from a new folder, or pin or unpin it",
    ADAPTERS_TAG,
    apidoc.ok("Updated", _STATUS),
    body=apidoc.json(schema.AdapterUpdate),
    body_required=False,
    params=[
        apidoc.Param("src", "A new folder under model_store / allowed_model_paths"),
        apidoc.Param("pin", "Pin (true) or unpin (false) it", _BOOL),
        apidoc.Param("preload", "With src: load its weights now (default true)", _BOOL),
    ],
)
UNREGISTER_ADAPTER = apidoc.Operation(
    "Unregister a LoRA adapter (requests running on it finish first)", ADAPTERS_TAG, apidoc.ok("Unregistered", _STATUS)
)


def ping_routes() -> list[BaseRoute]:
    """Health; first in the table (the inference routes follow it, then `routes()`)."""
    return protocol_routes(
        RENDERER, [], public=[apidoc.document(Route("/ping", management.ping, methods=["GET", "POST"]), *PING)]
    )


def routes(settings: Settings) -> list[BaseRoute]:
    """The management API, unless `enable_management_api` is off."""
    if not settings.enable_management_api:
        return []
    doc = apidoc.document
    return protocol_routes(
        MANAGEMENT,
        [
            *adapter_routes("/models/{model_name}/adapters"),
            *adapter_routes("/adapters"),
            doc(Route("/models", management.list_models, methods=["GET"]), LIST),
            doc(Route("/models", management.register_model, methods=["POST"]), REGISTER),
            doc(Route("/models/{model_name}", management.describe_model, methods=["GET"]), DESCRIBE),
            doc(Route("/models/{model_name}", management.unregister_model, methods=["DELETE"]), UNREGISTER),
            doc(Route("/models/{model_name}/{version}", management.describe_model, methods=["GET"]), DESCRIBE),
            doc(Route("/models/{model_name}/{version}", management.unregister_model, methods=["DELETE"]), UNREGISTER),
        ],
    )


def adapter_routes(base: str) -> list[BaseRoute]:
    """The adapters API under `base` (``/models/{model_name}/adapters`` or ``/adapters``). They come
    before the model routes: ``/models/{m}/{version}`` would answer ``GET /models/{m}/adapters`` and
    ``DELETE /models/{m}/adapters`` (which answers 405 here, rather than unregister the model)."""
    doc = apidoc.document
    one = base + "/{adapter_name}"
    routes: list[BaseRoute] = [
        doc(Route(base, adapters.list_adapters, methods=["GET"]), LIST_ADAPTERS),
        doc(Route(base, adapters.register_adapter, methods=["POST"]), REGISTER_ADAPTER),
        doc(Route(one, adapters.describe_adapter, methods=["GET"]), DESCRIBE_ADAPTER),
        doc(Route(one, adapters.unregister_adapter, methods=["DELETE"]), UNREGISTER_ADAPTER),
        doc(Route(one + "/update", adapters.update_adapter, methods=["POST"]), UPDATE_ADAPTER),
    ]
    if base.startswith("/models/"):
        routes.append(apidoc.hidden(Route(base, adapters.not_allowed, methods=["DELETE"])))
    return routes
