"""OpenAI's model list: GET /v1/models, every served text model (generative, embedding, reranker) and
every LoRA adapter, with vLLM's fields; and vLLM's runtime adapter routes, POST /v1/load_lora_adapter
and POST /v1/unload_lora_adapter (with the management API: `enable_management_api`). OpenAI routes, so
their errors are OpenAI's error object (`errors.RENDERER`): a missing or wrong API key is a 401
``authentication_error`` / ``invalid_api_key`` that the `openai` SDK raises as ``AuthenticationError``;
an adapter that cannot be loaded, or is loaded already, a 400 (vLLM's); an unknown one a 404; a path
outside model_store and allowed_model_paths a 403."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.config import Settings
from lmiserve.core import request_context
from lmiserve.core.errors import AdapterNotFound, InvalidRequest
from lmiserve.models import adapters
from lmiserve.models.service import ModelService
from lmiserve.models.text_encoders import EMBEDDING, RERANKER, kind_of
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.textgen.body import json_payload, parse
from lmiserve.protocols.textgen.served import Served
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str = Field(description="A model: its own id; a LoRA adapter: its folder")
    parent: str | None = Field(None, description="A LoRA adapter: the model it adapts; a model: null")
    max_model_len: int | None = Field(
        description="max_total_tokens (prompt and generation; an embedding or reranker model: its longest "
        "input); null while loading"
    )


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


async def models(request: Request) -> Response:
    """Every served text model (generative, and the embedding and reranker models of /v1/embeddings and
    the rerank routes, as vLLM lists them), with vLLM's `root`, `parent` and `max_model_len` (the longest
    prompt plus generation it takes: max_total_tokens; an encoder's longest input; null while it loads)."""
    data = []
    for service in request.app.state.registry:
        ready = service.status == ModelService.READY
        if service.is_llm:
            max_len = Served.of(service).limits.max_total_tokens if ready else None
        elif ready and kind_of(service) in (EMBEDDING, RERANKER):
            max_len = getattr(service.loaded, "max_length", None)
        else:
            continue
        card = {"id": service.name, "object": "model", "created": 0, "owned_by": service.name}
        data.append({**card, "root": service.name, "parent": None, "max_model_len": max_len})
        registry = service.adapters if ready else None
        for entry in registry.entries() if registry is not None else ():  # vLLM's adapter cards
            card = {"id": entry.name, "object": "model", "created": int(entry.registered_at), "owned_by": service.name}
            data.append({**card, "root": str(entry.src), "parent": service.name, "max_model_len": None})
    return raw_response(dumps({"object": "list", "data": data}))


class LoadLoraAdapter(BaseModel):
    """vLLM's LoadLoRAAdapterRequest."""

    lora_name: str | None = None
    lora_path: str | None = Field(None, description="A PEFT LoRA adapter folder (model_store, allowed_model_paths)")
    load_inplace: bool = Field(False, description="An adapter of that name is loaded again from lora_path")


class UnloadLoraAdapter(BaseModel):
    """vLLM's UnloadLoRAAdapterRequest."""

    lora_name: str | None = None
    lora_int_id: int | None = Field(None, description="Accepted, unused")


VLLM = adapters.Wording(
    exists=lambda name: InvalidRequest(f"The lora adapter '{name}' has already been loaded."),
    unknown=lambda name: AdapterNotFound(f"The lora adapter '{name}' cannot be found."),
)


def _text(message: str) -> Response:
    return raw_response(message.encode(), content_type="text/plain; charset=utf-8")


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/load_lora_adapter ``{"lora_name": ..., "lora_path": ...}``: 200 and a line of text."""
    req = parse(LoadLoraAdapter, await json_payload(request))
    if not req.lora_name or not req.lora_path:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
    request_context.note(adapter=req.lora_name)
    service = lookup.lora_service(request)
    roots = request.app.state.settings.model_roots()
    if req.load_inplace and req.lora_name in adapters.adapters_of(service):
        name = req.lora_name
        await adapters.update(service, name, roots=roots, src=req.lora_path, wording=VLLM, src_param="lora_path")
    else:
        models = [s.name for s in request.app.state.registry]
        await adapters.register(
            service,
            req.lora_name,
            req.lora_path,
            roots=roots,
            models=models,
            wording=VLLM,
            name_param="lora_name",
            src_param="lora_path",
        )
    return _text(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's POST /v1/unload_lora_adapter ``{"lora_name": ...}``: requests running on it finish first."""
    req = parse(UnloadLoraAdapter, await json_payload(request))
    if not req.lora_name:
        raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
    request_context.note(adapter=req.lora_name)
    adapters.unregister(lookup.lora_service(request), req.lora_name, wording=VLLM)
    return _text(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


MODELS = apidoc.Operation(
    "The served text models (generation, embedding, rerank) and LoRA adapters",
    "OpenAI",
    apidoc.ok("Models", apidoc.json(ModelList)),
)
_DONE = {apidoc.TEXT: apidoc.STRING}
LOAD = apidoc.Operation(
    "Load a LoRA adapter (vLLM's)",
    "vLLM",
    apidoc.ok("Loaded: Success: LoRA adapter '<name>' added successfully.", _DONE),
    body=apidoc.json(LoadLoraAdapter),
)
UNLOAD = apidoc.Operation(
    "Unload a LoRA adapter (vLLM's; requests running on it finish first)",
    "vLLM",
    apidoc.ok("Unloaded: Success: LoRA adapter '<name>' removed successfully.", _DONE),
    body=apidoc.json(UnloadLoraAdapter),
)


def routes(settings: Settings | None = None) -> Sequence[BaseRoute]:
    """GET /v1/models; vLLM's adapter routes too unless the management API is off."""
    table = [apidoc.document(Route("/v1/models", models, methods=["GET"]), MODELS)]
    if settings is None or settings.enable_management_api:
        table += [
            apidoc.document(Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]), LOAD),
            apidoc.document(Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]), UNLOAD),
        ]
    return protocol_routes(RENDERER, table)
