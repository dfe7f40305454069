"""Health and LMI management routes: /ping, GET /models, GET /models/{name}."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from lmiserve.core.errors import ModelNotFound
from lmiserve.http.responses import error_response, raw_response
from lmiserve.http.service import ModelService
from lmiserve.models import DEFAULT_MODEL_NAME


def _pretty(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


async def ping(request: Request) -> Response:
    """200 with every model Healthy; 503 while a model loads or after it failed."""
    service: ModelService = request.app.state.service
    healthy = service.status == ModelService.READY
    body = {service.name: {"status": "Healthy" if healthy else "Unhealthy"}}
    return raw_response(_pretty(body), 200 if healthy else 503)


def _model_url(service: ModelService) -> str:
    path = service.path or service.settings.model_id
    return f"file:{path}" if path else f"bundled:{DEFAULT_MODEL_NAME}"


async def list_models(request: Request) -> Response:
    service: ModelService = request.app.state.service
    entry = {"modelName": service.name, "modelUrl": _model_url(service), "status": service.status}
    return raw_response(_pretty({"models": [entry]}))


async def describe_model(request: Request) -> Response:
    service: ModelService = request.app.state.service
    name = request.path_params["model_name"]
    if name != service.name:
        return error_response(ModelNotFound(f"Model or workflow not found: {name}"))
    s = service.settings
    engine = service.engine
    device = service.loaded.device if service.loaded is not None else None
    worker_status = {"READY": "READY", "PENDING": "PENDING"}.get(service.status, "FAILED")
    model = {
        "modelName": service.name,
        "modelUrl": _model_url(service),
        "batchSize": s.batch_size if s.dynamic_batching else s.max_rolling_batch_size,
        "maxBatchDelayMillis": s.max_batch_delay,
        "maxIdleSeconds": 60,
        "queueSize": s.job_queue_size,
        "requestInQueue": engine.num_waiting if engine is not None else 0,
        "status": "Healthy" if service.status == ModelService.READY else "Unhealthy",
        "loadedAtStartup": True,
        "workerGroups": [
            {
                "device": {"deviceType": device.type if device else "cpu", "deviceId": device.index or 0 if device else 0},
                "minWorkers": 1,
                "maxWorkers": 1,
                "workers": [{"id": 1, "startTime": _iso(service.started_at), "status": worker_status}],
            }
        ],
    }
    return raw_response(_pretty([{"workflowName": service.name, "version": "", "models": [model]}]))


def _iso(ts: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()
