"""The cross-encoder routes vLLM serves beside its OpenAI routes, for reranker models (a sequence
classifier with a one-label head: a sentence-transformers CrossEncoder, bge-reranker, ...):

- Jina's and Cohere's rerank, ``POST /v1/rerank`` and ``POST /v2/rerank``: ``{"model"?, "query",
  "documents": [str | {"text": str}], "top_n"?, "return_documents"?: true}`` answered
  ``{"id", "model", "usage": {"total_tokens"}, "results": [{"index", "relevance_score",
  "document": {"text"}}]}``, the best `top_n` (all without it) by `relevance_score`, highest first;
  ``return_documents: false`` leaves `document` out.
- vLLM's score, ``POST /score`` and ``POST /v1/score``: ``{"model"?, "text_1", "text_2"}`` (each a
  string or a list: one `text_1` against every `text_2`, or pairs position by position) answered
  ``{"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}],
  "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0}}`` in the order of the pairs.

Each (query, document) pair is tokenized as the model's pair input (segment ids included) and scored
through the model's one-shot batcher (lmiserve/models/text_encoders.py). A score is the model's own:
its logit through its CrossEncoder activation (sigmoid unless the config names the identity). Rerank
cuts a pair longer than the model takes to fit (as Jina and Cohere do, the longer side first); score
answers such a pair with a 400 ``context_length_exceeded``, as vLLM does. Errors are OpenAI's error
object: 404 for an unknown `model`, 400 for a model that is not a reranker and for every bad field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import ModelNotFound, excerpt
from lmiserve.models import text_encoders as te
from lmiserve.protocols.openai.errors import RENDERER, ContextWindowExceeded, InvalidValue
from lmiserve.protocols.textgen.body import json_payload, parse_strict
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response

TAG = "vLLM"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentText(_Strict):
    text: StrictStr


class RerankRequest(_Strict):
    model: str | None = Field(None, description="A served reranker (default: the only one)")
    query: StrictStr
    documents: list[StrictStr | DocumentText] = Field(description="Texts, or objects with `text`")
    top_n: int | None = Field(None, ge=0, description="Answer the best N (0 or absent: all)")
    return_documents: StrictBool = Field(True, description="Include each document's text in its result")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(_Strict):
    model: str | None = Field(None, description="A served reranker (default: the only one)")
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


def _model(request: Request, name: str | None) -> te.TextModel:
    try:
        return lookup.reranker_model(request, name)
    except ModelNotFound:
        if name is None:
            raise
        raise ModelNotFound(f"The model `{excerpt(name)}` does not exist.") from None


async def _scores(model: te.TextModel, pairs: list[tuple[str, str]], *, truncate: bool) -> tuple[np.ndarray, int]:
    try:
        rows = await model.tokenize([q for q, _ in pairs], [d for _, d in pairs], truncate=truncate)
    except te.InputTooLong as exc:
        raise ContextWindowExceeded(exc, "text_2") from None
    return te.activated(model, await te.scores(model, rows)), te.tokens_of(rows)


async def rerank(request: Request) -> Response:
    req: RerankRequest = parse_strict(RerankRequest, await json_payload(request))
    if not req.documents:
        raise InvalidValue("`documents` must not be empty.", "documents")
    te.check_count(len(req.documents), "documents")
    model = _model(request, req.model)
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    scores, tokens = await _scores(model, [(req.query, t) for t in texts], truncate=True)
    order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))
    if req.top_n:
        order = order[: req.top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    body = {"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "usage": {"total_tokens": tokens}}
    return raw_response(dumps({**body, "results": results}))


async def score(request: Request) -> Response:
    req: ScoreRequest = parse_strict(ScoreRequest, await json_payload(request))
    pairs = te.pairs_of(req.text_1, req.text_2)
    te.check_count(len(pairs), "pairs")
    model = _model(request, req.model)
    scores, tokens = await _scores(model, pairs, truncate=False)
    body = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }
    return raw_response(dumps(body))


RERANK = apidoc.Operation(
    "Rerank documents against a query (Jina/Cohere shape; reranker models)",
    TAG,
    apidoc.ok("The documents by relevance, highest first", apidoc.json(RerankResponse)),
    body=apidoc.json(RerankRequest),
)
SCORE = apidoc.Operation(
    "Score text pairs (vLLM's /score; reranker models)",
    TAG,
    apidoc.ok("One score per pair", apidoc.json(ScoreResponse)),
    body=apidoc.json(ScoreRequest),
)


def routes() -> list[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/v1/rerank", rerank, methods=["POST"]), RERANK),
            apidoc.document(Route("/v2/rerank", rerank, methods=["POST"]), RERANK),
            apidoc.document(Route("/score", score, methods=["POST"]), SCORE),
            apidoc.document(Route("/v1/score", score, methods=["POST"]), SCORE),
        ],
    )
