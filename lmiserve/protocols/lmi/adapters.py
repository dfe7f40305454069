"""LMI's adapters API (DJL Serving's) and SageMaker's: the LoRA adapters of a model, managed at run time.

    POST   /models/{model}/adapters?name=&src=[&preload=true&pin=false]   register (or a JSON body)
    GET    /models/{model}/adapters[?limit=100&next_page_token=N]          list, a page at a time
    GET    /models/{model}/adapters/{name}                                 describe
    POST   /models/{model}/adapters/{name}/update[?src=&pin=&preload=]     update
    DELETE /models/{model}/adapters/{name}                                 unregister

and the same without ``/models/{model}`` for the served LLM (SageMaker's adapter routes are
``POST /adapters`` with ``{"name": ..., "src": ...}`` and ``DELETE /adapters/{name}``). Answers and
errors are the management API's (front-end JSON, `errors.MANAGEMENT`): 400 BadRequestException (a
missing or bad parameter, an adapter that does not fit the model, a model without enable_lora), 403
ForbiddenException (src outside model_store and allowed_model_paths), 404 (an unknown model:
ModelNotFoundException; an unknown adapter: ResourceNotFoundException), 409 ConflictStatusException (a
name already registered). The work is `lmiserve.models.adapters`.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core import request_context
from lmiserve.models import adapters
from lmiserve.models.service import ModelService
from lmiserve.protocols.lmi.management import _int_param, _iso, _pretty, _registration_params
from lmiserve.server import lookup
from lmiserve.server.responses import raw_response


def _service(request: Request) -> ModelService:
    """The model of ``/models/{model_name}/adapters...``; without a name, the one served with adapters."""
    return lookup.lora_service(request, request.path_params.get("model_name"))


def _adapter_name(request: Request) -> str:
    name = request.path_params["adapter_name"]
    request_context.note(adapter=name)
    return name


def _models(request: Request) -> list[str]:
    return [s.name for s in request.app.state.registry]


def _summary(entry) -> dict:
    return {"name": entry.name, "src": str(entry.src), "pin": entry.pinned, "loaded": entry.loaded is not None}


async def list_adapters(request: Request) -> Response:
    """GET .../adapters[?limit=100&next_page_token=N]: one page; nextPageToken only when more follow."""
    limit = _int_param(request, "limit", 100)
    start = _int_param(request, "next_page_token", 0)
    entries = adapters.adapters_of(_service(request)).entries()
    limit = limit if 0 < limit <= 100 else 100
    body: dict = {"nextPageToken": str(start + limit)} if start + limit < len(entries) else {}
    body["adapters"] = [_summary(e) for e in entries[start : start + limit]]
    return raw_response(_pretty(body))


async def register_adapter(request: Request) -> Response:
    """POST .../adapters?name=&src=[&preload=true&pin=false] (or the same keys in a JSON body)."""
    params = await _registration_params(request)
    service = _service(request)
    name = params.get("name")
    if isinstance(name, str):
        request_context.note(adapter=name)
    entry = await adapters.register(
        service,
        name,
        params.get("src"),
        roots=request.app.state.settings.model_roots(),
        preload=adapters.flag(params.get("preload"), "preload", True),
        pin=adapters.flag(params.get("pin"), "pin", False),
        models=_models(request),
    )
    return raw_response(_pretty({"status": f"Adapter {entry.name} registered"}))


async def describe_adapter(request: Request) -> Response:
    """GET .../adapters/{adapter_name}: the adapter, and when loaded its rank, targets and size."""
    name = _adapter_name(request)
    service = _service(request)
    entry = adapters.entry(service, name)
    figures = adapters.describe(adapters.adapters_of(service), entry)
    body = {
        **_summary(entry),
        "rank": figures["rank"],
        "targetModules": figures["target_modules"],
        "sizeBytes": figures["nbytes"],
        "requests": figures["requests"],
        "running": figures["running"],
        "registeredAt": _iso(entry.registered_at),
        "error": figures["error"],
    }
    return raw_response(_pretty({k: v for k, v in body.items() if v is not None}))


async def update_adapter(request: Request) -> Response:
    """POST .../adapters/{adapter_name}/update[?src=&pin=&preload=]: a new source (read again; requests
    running on the old weights finish on them) or pinning."""
    params = await _registration_params(request)
    name = _adapter_name(request)
    service = _service(request)
    pin = params.get("pin")
    await adapters.update(
        service,
        name,
        roots=request.app.state.settings.model_roots(),
        src=params.get("src"),
        pin=None if pin is None or pin == "" else adapters.flag(pin, "pin", False),
        preload=adapters.flag(params.get("preload"), "preload", True),
    )
    return raw_response(_pretty({"status": f"Adapter {name} updated"}))


async def unregister_adapter(request: Request) -> Response:
    """DELETE .../adapters/{adapter_name}: requests running on it finish first, on its weights."""
    name = _adapter_name(request)
    adapters.unregister(_service(request), name)
    return raw_response(_pretty({"status": f"Adapter {name} unregistered"}))


async def not_allowed(request: Request) -> Response:
    """DELETE /models/{model_name}/adapters: 405 (without this route, DELETE /models/{m}/{version} would
    match and unregister the model)."""
    raise HTTPException(405)
