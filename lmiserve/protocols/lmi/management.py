"""Health and the LMI management API: /ping, GET/POST/DELETE /models.

Errors are raised as neutral classes and answered by `lmiserve.protocols.lmi.errors.MANAGEMENT`
(front-end JSON): an invalid parameter 400 BadRequestException, a model path outside model_store and
allowed_model_paths 403 ForbiddenException, an unknown model 404 ModelNotFoundException, a name
already registered 409 ConflictStatusException, a model that failed to load 500
InternalServerException.
"""

from __future__ import annotations

import json
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.config import ConfigError
from lmiserve.core import jsondoc
from lmiserve.core.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    MalformedBody,
    SchemaViolation,
)
from lmiserve.models import DEFAULT_MODEL_NAME
from lmiserve.models.service import ModelService
from lmiserve.models.store import allowed_path
from lmiserve.server.responses import raw_response

# Registration options (query parameters or JSON body keys) that become model settings.
SETTING_PARAMS = (
    "batch_size",
    "max_batch_delay",
    "job_queue_size",
    "device",
    "dtype",
    "model_kind",
    "revision",  # of a Hub model (url=org/name, with allowed_model_urls)
    "gguf_file",
)


def _pretty(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _registry(request: Request):
    return request.app.state.registry


async def ping(request: Request) -> Response:
    """200 with every model Healthy; 503 while a model loads or after one failed."""
    services = list(_registry(request))
    body = {s.name: {"status": "Healthy" if s.status == ModelService.READY else "Unhealthy"} for s in services}
    healthy = all(s.status == ModelService.READY for s in services)
    return raw_response(_pretty(body), 200 if healthy else 503)


def _model_url(service: ModelService) -> str:
    path = service.path or service.settings.model_id
    return f"file:{path}" if path else f"bundled:{DEFAULT_MODEL_NAME}"


async def list_models(request: Request) -> Response:
    """GET /models[?limit=100&next_page_token=N]: one page; nextPageToken only when more follow."""
    limit = _int_param(request, "limit", 100)
    start = _int_param(request, "next_page_token", 0)
    services = list(_registry(request))
    limit = limit if 0 < limit <= 100 else 100
    page = services[start : start + limit]
    body: dict = {"nextPageToken": str(start + limit)} if start + limit < len(services) else {}
    body["models"] = [{"modelName": s.name, "modelUrl": _model_url(s), "status": s.status} for s in page]
    return raw_response(_pretty(body))


def _int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise InvalidRequest(f"Parameter {name} must be an integer: {value}") from None
    if number < 0:
        raise InvalidRequest(f"Parameter {name} must not be negative: {value}")
    return number


async def describe_model(request: Request) -> Response:
    service = _registry(request).get(request.path_params["model_name"])
    s = service.settings
    engine = service.engine
    device = getattr(service.loaded, "device", None)
    worker_status = {"READY": "READY", "PENDING": "PENDING"}.get(service.status, "FAILED")
    model = {
        "modelName": service.name,
        "modelUrl": _model_url(service),
        "batchSize": s.batch_size if s.dynamic_batching or not service.is_llm else s.max_rolling_batch_size,
        "maxBatchDelayMillis": s.max_batch_delay,
        "maxIdleSeconds": 60,
        "queueSize": s.job_queue_size,
        "requestInQueue": engine.num_waiting if engine is not None else 0,
        "status": "Healthy" if service.status == ModelService.READY else "Unhealthy",
        "loadedAtStartup": service.loaded_at_startup,
        "workerGroups": [
            {
                "device": {
                    "deviceType": device.type if device else "cpu",
                    "deviceId": device.index or 0 if device else 0,
                },
                "minWorkers": 1,
                "maxWorkers": 1,
                "workers": [{"id": 1, "startTime": _iso(service.started_at), "status": worker_status}],
            }
        ],
    }
    return raw_response(_pretty([{"workflowName": service.name, "version": "", "models": [model]}]))


async def register_model(request: Request) -> Response:
    """POST /models?url=...&model_name=...[&synchronous=true&batch_size=...]: load a model and serve it."""
    from lmiserve.models import default_model_name
    from lmiserve.models.store import model_settings, remote_source

    params = await _registration_params(request)
    base = request.app.state.settings
    remote = remote_source(params.get("url"), base)
    overrides = {k: params[k] for k in SETTING_PARAMS if params.get(k) not in (None, "")}
    directory: Path | None = None
    if remote is not None:  # fetched when it loads (models/download), as a model named at start is
        overrides["model_id"] = remote
        name = str(params.get("model_name") or default_model_name(remote))
    else:
        directory = _local_path(params.get("url"), base.model_roots())
        name = str(params.get("model_name") or (directory.stem if directory.is_file() else directory.name))
    registry = _registry(request)
    if name in registry:
        raise Conflict(f"Model {name} is already registered.")
    if directory is not None and directory.is_file():  # a .pt or .gguf file: its folder holds the properties
        directory, overrides["model_id"] = directory.parent, str(directory)
    try:
        settings = model_settings(base, directory, name, overrides)
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None
    if not settings.model_id:  # nothing to load: never fall back to the bundled default model
        raise InvalidRequest(
            f"No model in {params.get('url')}: no weights (config.json, .safetensors, .gguf, .pt) "
            "and no model_id in a serving.properties."
        )
    service = ModelService(settings, name=name)
    service.loaded_at_startup = False
    registry.add(service)
    if str(params.get("synchronous", "true")).strip().lower() in ("false", "0", "no"):
        import asyncio

        request.app.state.pending_loads = getattr(request.app.state, "pending_loads", set())
        task = asyncio.create_task(service.load())
        request.app.state.pending_loads.add(task)
        task.add_done_callback(request.app.state.pending_loads.discard)
        return raw_response(_pretty({"status": f'Model "{name}" registration scheduled.'}), 202)
    await service.load()
    if service.status != ModelService.READY:
        await registry.remove(name)
        if service.download_failed:  # the URL named no model this server can fetch: the caller's to fix
            raise InvalidRequest(f"Failed to download model {name}: {service.error_summary}")
        raise InternalError(f"Failed to load model {name}: {service.error}")
    return raw_response(_pretty({"status": f'Model "{name}" registered.'}))


async def unregister_model(request: Request) -> Response:
    """DELETE /models/{name}[/{version}]: stop the model and forget it."""
    name = request.path_params["model_name"]
    await _registry(request).remove(name)
    return raw_response(_pretty({"status": f'Workflow "{name}" unregistered'}))


async def _registration_params(request: Request) -> dict:
    params: dict = dict(request.query_params)
    body = await request.body()
    if body.strip() and "json" in request.headers.get("content-type", "json"):
        try:
            data = jsondoc.loads(body)
        except ValueError as exc:
            raise MalformedBody(f"Invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise SchemaViolation("The request body must be a JSON object.")
        params = {**{k: v for k, v in data.items() if v is not None}, **params}
    return params


def _local_path(url, roots: list[Path]) -> Path:
    """The model directory or file `url` names, if it lies under one of `roots` (`allowed_path`)."""
    return allowed_path(url, roots)


def _iso(ts: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()
