"""OpenAI's model list: GET /v1/models, every served text model (generative, embedding, reranker) with
vLLM's fields. An OpenAI route, so its
errors are OpenAI's error object (`errors.RENDERER`): a missing or wrong API key is a 401
``authentication_error`` / ``invalid_api_key`` that the `openai` SDK raises as ``AuthenticationError``."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.models.service import ModelService
from lmiserve.models.text_encoders import EMBEDDING, RERANKER, kind_of
from lmiserve.protocols.openai.errors import RENDERER
from lmiserve.protocols.textgen.served import Served
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str = Field(description="The model this one derives from: itself (no adapters)")
    parent: str | None = None
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
    return raw_response(dumps({"object": "list", "data": data}))


MODELS = apidoc.Operation(
    "The served text models (generation, embedding, rerank)", "OpenAI", apidoc.ok("Models", apidoc.json(ModelList))
)


def routes() -> Sequence[BaseRoute]:
    return protocol_routes(RENDERER, [apidoc.document(Route("/v1/models", models, methods=["GET"]), MODELS)])
