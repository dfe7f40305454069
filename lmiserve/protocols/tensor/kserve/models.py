"""How KServe V2 routes find the addressed model: `/v2/models/{model}[/versions/{version}]/...`.

MLServer's words: an unknown name is 404 `Model <m> not found`, an unknown version 404
`Model <m> with version <v> not found`; a model still loading (or failed) is 503
`Model <m> is not ready yet.`. Every model has one version, `VERSION`.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from lmiserve.core import request_context
from lmiserve.core.errors import ModelNotFound, ModelNotReady, NotFound, SchemaViolation
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService
from lmiserve.protocols.tensor.kserve.parse import VERSION
from lmiserve.server import lookup


def resolve(request: Request) -> ModelService:
    """The addressed model's service, whatever its state."""
    name = request.path_params["model"]
    try:
        svc = lookup.model_service(request, name)
    except ModelNotFound:
        raise ModelNotFound(f"Model {name} not found") from None
    check_version(name, request.path_params.get("version"))
    return svc


def find(registry: ModelRegistry, name: str, version: str | None) -> ModelService:
    """`resolve` for a transport without a starlette request (gRPC): the model `name` of `registry`,
    whatever its state, in the same words; `version` None or empty: the one version."""
    if not name:
        raise SchemaViolation("the request needs a model name")
    svc = registry.find(name)
    if svc is None:
        raise ModelNotFound(f"Model {name} not found")
    request_context.note(model=svc.name)
    check_version(name, version or None)
    return svc


def check_version(name: str, version: str | None) -> None:
    if version is not None and version != VERSION:
        raise NotFound(f"Model {name} with version {version} not found")


def check_ready(svc: ModelService) -> None:
    if not lookup.is_ready(svc):
        raise ModelNotReady(f"Model {svc.name} is not ready yet.")


def ready_model(request: Request) -> tuple[ModelService, Any]:
    """(service, TensorModel) of the addressed model, which must be ready."""
    svc = resolve(request)
    check_ready(svc)
    return svc, svc.tensor_model


def ready_in(registry: ModelRegistry, name: str, version: str | None) -> tuple[ModelService, Any]:
    """`ready_model` for a transport without a starlette request (gRPC)."""
    svc = find(registry, name, version)
    check_ready(svc)
    return svc, svc.tensor_model
