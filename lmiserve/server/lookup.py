"""What the tensor protocols' health and model routes ask of the registry: the served models and
whether they are ready. Models are found by name with `lmiserve.models.service.model_service`."""

from __future__ import annotations

from starlette.requests import Request

from lmiserve.models.service import ModelService


def services(request: Request) -> list[ModelService]:
    """Every registered model, in registration order."""
    return list(request.app.state.registry)


def is_ready(svc: ModelService) -> bool:
    return svc.status == ModelService.READY


def all_ready(request: Request) -> bool:
    """At least one model is registered and every model is ready."""
    models = services(request)
    return bool(models) and all(is_ready(s) for s in models)
