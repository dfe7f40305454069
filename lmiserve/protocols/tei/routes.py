"""Hugging Face text-embeddings-inference's routes: ``POST /embed`` for embedding models and
``POST /rerank`` for rerankers (a one-label sequence classifier, such as a sentence-transformers
CrossEncoder).

- ``/embed``: ``{"inputs": str | [str], "normalize"?: true, "truncate"?: false,
  "truncation_direction"?: "Right", "prompt_name"?, "dimensions"?}`` answered ``[[float, ...], ...]``
  (one vector per input, a list even for one string). ``normalize`` L2-normalises the pooled vector
  (TEI's default) whatever the model's own pipeline says; ``prompt_name`` puts that prompt of the
  model's `config_sentence_transformers.json` before each input; ``dimensions`` cuts Matryoshka models.
- ``/rerank``: ``{"query", "texts": [str], "truncate"?: false, "truncation_direction"?: "Right",
  "raw_scores"?: false, "return_text"?: false}`` answered ``[{"index", "score", "text"?}]`` from the
  highest score; a score is the sigmoid of the model's logit, the logit itself with ``raw_scores``.

Without ``truncate`` an input longer than the model takes is a 413 (``Validation``); with it the
input is cut from ``truncation_direction`` (``Left``/``Right``, any case). TEI serves one model, so
these routes use the only served model of their kind (a 400 ``Backend`` "model is not ..." when the
only model is of another kind). The vectors and scores are those of the OpenAI routes and the tensor
routes for the same text (lmiserve/models/text_encoders.py). Errors: `errors.RENDERER`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import InvalidRequest
from lmiserve.models import text_encoders as te
from lmiserve.protocols.tei.errors import RENDERER, EmptyBatch
from lmiserve.protocols.textgen.body import json_payload, parse_strict
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response

TAG = "TEI"
Direction = Literal["Left", "Right", "left", "right"]

DESERIALIZE = "Failed to deserialize the JSON body into the target type: "  # TGI/TEI's 422 text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedRequest(_Strict):
    inputs: StrictStr | list[StrictStr]
    normalize: StrictBool = Field(True, description="L2-normalise each vector")
    truncate: StrictBool = Field(False, description="Cut inputs longer than the model takes (else 413)")
    truncation_direction: Direction = Field("Right", description="Which end `truncate` cuts")
    prompt_name: str | None = Field(None, description="A prompt of the model's sentence-transformers config")
    dimensions: int | None = Field(None, ge=1, description="Cut to the first N dimensions (Matryoshka models)")


class RerankRequest(_Strict):
    query: StrictStr
    texts: list[StrictStr]
    truncate: StrictBool = False
    truncation_direction: Direction = "Right"
    raw_scores: StrictBool = Field(False, description="The logits, not their sigmoid")
    return_text: StrictBool = Field(False, description="Include each text in its result")


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = None


async def embed(request: Request) -> Response:
    req: EmbedRequest = parse_strict(EmbedRequest, await json_payload(request), DESERIALIZE)
    texts = [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)
    if not texts:
        raise EmptyBatch("Batch is empty")
    te.check_count(len(texts), "inputs")
    model = lookup.embedding_model(request, None)
    te.check_dimensions(model, req.dimensions)
    if req.prompt_name is not None:
        prompts: dict[str, str] = getattr(model.runner, "prompts", {})
        if req.prompt_name not in prompts:
            raise InvalidRequest(f"Prompt name `{req.prompt_name}` not found in the configuration")
        texts = [prompts[req.prompt_name] + t for t in texts]
    side = req.truncation_direction.lower()
    rows = await model.tokenize(texts, truncate=req.truncate, side=side)
    vectors = await te.embed(model, rows, normalize=req.normalize, dimensions=req.dimensions)
    return raw_response(dumps(vectors.astype("float64").tolist()))


async def rerank(request: Request) -> Response:
    req: RerankRequest = parse_strict(RerankRequest, await json_payload(request), DESERIALIZE)
    if not req.texts:
        raise EmptyBatch("`texts` cannot be empty")
    te.check_count(len(req.texts), "texts")
    model = lookup.reranker_model(request, None)
    side = req.truncation_direction.lower()
    rows = await model.tokenize([req.query] * len(req.texts), req.texts, truncate=req.truncate, side=side)
    logits = await te.scores(model, rows)
    scores = logits if req.raw_scores else te.sigmoid(logits)
    ranks: list[dict[str, Any]] = []
    for i in sorted(range(len(req.texts)), key=lambda i: -float(scores[i])):
        rank: dict[str, Any] = {"index": i, "score": float(scores[i])}
        if req.return_text:
            rank["text"] = req.texts[i]
        ranks.append(rank)
    return raw_response(dumps(ranks))


EMBED = apidoc.Operation(
    "Embeddings of texts (text-embeddings-inference; embedding models)",
    TAG,
    apidoc.ok("One vector per input", apidoc.json(list[list[float]])),
    body=apidoc.json(EmbedRequest),
)
RERANK = apidoc.Operation(
    "Rank texts against a query (text-embeddings-inference; reranker models)",
    TAG,
    apidoc.ok("The texts by score, highest first", apidoc.json(list[Rank])),
    body=apidoc.json(RerankRequest),
)


def routes() -> list[BaseRoute]:
    return protocol_routes(
        RENDERER,
        [
            apidoc.document(Route("/embed", embed, methods=["POST"]), EMBED),
            apidoc.document(Route("/rerank", rerank, methods=["POST"]), RERANK),
        ],
    )
