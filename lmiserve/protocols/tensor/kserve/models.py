"""How KServe V2 routes find the addressed model: `/v2/models/{model}[/versions/{version}]/...`.

MLServer's words: an unknown name is 404 `Model <m> not found`, an unknown version 404
`Model <m> with version <v> not found`; a model still loading (or failed) is 503
`Model <m> is not ready yet.`. Every model has one version, `VERSION`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from lmiserve.core.errors import ModelNotFound, ModelNotReady, NotFound
from lmiserve.models.service import ModelService, model_service
from lmiserve.protocols.tensor.kserve.parse import VERSION
from lmiserve.server import lookup


def resolve(request: Request) -> ModelService:
    """The addressed model's service, whatever its state."""
    name = request.path_params["model"]
    try:
        svc = model_service(request, name)
    except ModelNotFound:
        raise ModelNotFound(f"Model {name} not found") from None
    version = request.path_params.get("version")
    if version is not None and version != VERSION:
        raise NotFound(f"Model {name} with version {version} not found")
    return svc


def check_ready(svc: ModelService) -> None:
    if not lookup.is_ready(svc):
        raise ModelNotReady(f"Model {svc.name} is not ready yet.")


def ready_model(request: Request) -> tuple[ModelService, Any]:
    """(service, TensorModel) of the addressed model, which must be ready."""
    svc = resolve(request)
    check_ready(svc)
    return svc, svc.tensor_model
