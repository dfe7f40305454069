"""How a request finds its model: the registry the app holds (`app.state.registry`, models/registry.py)
asked by name, or for the default one. Every route resolves its model through here, so how models are
held is one place; each lookup notes the model the request addressed (its access line, its span).

`models/` takes names and services, never a request: this module is the HTTP side of it."""

from __future__ import annotations

from starlette.requests import Request

from lmiserve.core import request_context
from lmiserve.core.errors import ModelNotFound
from lmiserve.models import text_encoders as te
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService


def registry(request: Request) -> ModelRegistry:
    """The served models of the app that `request` reached."""
    served: ModelRegistry = request.app.state.registry
    return served


def services(request: Request) -> list[ModelService]:
    """Every registered model, in registration order."""
    return list(registry(request))


def is_ready(svc: ModelService) -> bool:
    return svc.status == ModelService.READY


def all_ready(request: Request) -> bool:
    """At least one model is registered and every model is ready."""
    models = services(request)
    return bool(models) and all(is_ready(s) for s in models)


def model_service(request: Request, name: str | None = None) -> ModelService:
    """The model a request addresses by name, else the default one; ModelNotFound for an unknown name."""
    service = registry(request).get(name) if name else registry(request).default()
    request_context.note(model=service.name)
    return service


def default_llm(request: Request) -> ModelService:
    """The generative model that name-less routes (TGI, OpenAI, plain /invocations) talk to."""
    service = registry(request).default_llm()
    request_context.note(model=service.name)
    return service


def adapter_owner(request: Request, name: str) -> ModelService | None:
    """The served LLM that has a LoRA adapter named `name` (None: no model has one); noted as the
    model the request addressed, as `model_service` notes it."""
    for service in registry(request):
        adapters = service.adapters
        if adapters is not None and name in adapters:
            request_context.note(model=service.name)
            return service
    return None


def lora_service(request: Request, name: str | None = None) -> ModelService:
    """The model whose adapters a request manages: `name`'s (ModelNotFound), else the one model served
    with LoRA adapters, else the served LLM (ModelRequired when several could be meant)."""
    if name:
        return model_service(request, name)
    with_lora = [s for s in registry(request) if s.adapters is not None]
    if len(with_lora) == 1:
        return model_service(request, with_lora[0].name)
    return default_llm(request)


# ---- the text encoders (models/text_encoders.py) ---------------------------------------------------------


def embedding_model(request: Request, name: str | None) -> te.TextModel:
    """The embedding model `name` names, or the only one served (`te.only_of_kind`)."""
    return _text_model(request, name, te.EMBEDDING)


def reranker_model(request: Request, name: str | None) -> te.TextModel:
    """The reranker `name` names, or the only one served (`te.only_of_kind`)."""
    return _text_model(request, name, te.RERANKER)


def _text_model(request: Request, name: str | None, wanted: str) -> te.TextModel:
    if name:
        service = _named_encoder(request, name, wanted)
    else:
        service = te.only_of_kind(services(request), wanted)
        request_context.note(model=service.name)
    return te.text_model(service, wanted)


def _named_encoder(request: Request, name: str, wanted: str) -> ModelService:
    """The model `name` names; a LoRA adapter of an LLM is `WrongModelKind` (it is no encoder)."""
    try:
        return model_service(request, name)
    except ModelNotFound:
        owner = adapter_owner(request, name)
        if owner is None:
            raise
        raise te.WrongModelKind(name, owner.kind, wanted, of=owner.name) from None
