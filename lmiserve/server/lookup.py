"""How tensor-protocol routes find models: by name through the registry, with their state.

Thin wrappers over `http.service` (model_service / tensor_model) so every tensor route resolves models
the same way, plus what the health and status routes need (all models, one model's state).
"""

from __future__ import annotations

from lmiserve.models.service import ModelService, model_service


def service(request, name: str) -> ModelService:
    """The named model (ModelNotFound if unknown)."""
    return model_service(request, name)


def services(request) -> list[ModelService]:
    return list(request.app.state.registry)


def all_ready(request) -> bool:
    models = services(request)
    return bool(models) and all(s.status == ModelService.READY for s in models)


def is_ready(svc: ModelService) -> bool:
    return svc.status == ModelService.READY
