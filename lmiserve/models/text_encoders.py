"""Embedding and reranker (cross-encoder) models as the text routes use them: OpenAI's /v1/embeddings,
TEI's /embed and /rerank, the Jina/Cohere rerank and vLLM score routes. Each protocol parses its own
requests and words its own answers and errors; what they compute is here, once, on the runner and the
one-shot batcher the tensor protocols use (oneshot/text.py, oneshot/batcher.py), so a text gets
the same pooling, normalisation and numbers whichever route carried it.

- `text_model(service, wanted)`, `only_of_kind(services, wanted)`: a served model as an embedding model
  or reranker, and the only one of that kind (`ModelNotFound`, `ModelRequired`, `WrongModelKind`,
  `ModelNotReady` otherwise); a request finds its model with `lmiserve.server.lookup.embedding_model`
  and `reranker_model`. A reranker is a sequence classifier with a one-label head (a
  sentence-transformers CrossEncoder, or any ``num_labels == 1`` ``*ForSequenceClassification``).
- `TextModel.tokenize`: token rows with the model's special tokens, texts or (query, document) pairs,
  cut to the model's length from either side, or checked against it (`InputTooLong`).
- `embed`: one vector per row, pooled as the model's sentence-transformers config says, L2-normalised
  or not, optionally cut to its first `dimensions` (Matryoshka models only; normalised again after
  the cut when normalised at all).
- `scores`: the one-label head's logit per pair; `activated` applies the model's activation (sigmoid
  unless its CrossEncoder config names the identity).

Rows go to the batcher in chunks of at most max(`batch_size`, 32) rows, so a request of many inputs
neither runs as one huge forward pass nor holds the queue: its chunks batch with other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from lmiserve.core.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, ModelNotReady, ModelRequired
from lmiserve.core.tokenizer import tokenizing
from lmiserve.models.service import ModelService

if TYPE_CHECKING:
    from lmiserve.oneshot.batcher import OneShotModel
    from lmiserve.oneshot.text import ClassifierRunner, EmbeddingRunner

EMBEDDING, RERANKER = "embedding", "reranker"
MAX_INPUTS = 2048  # most texts (or documents) in one request: OpenAI's limit for embeddings
CHUNK_ROWS = 32  # rows per job handed to the batcher (at least; `batch_size` when larger)

TokenRow = dict[str, list[int]]  # input_ids, and token_type_ids for pairs


class WrongModelKind(InvalidRequest):
    """The addressed model is not of the kind the route needs (an LLM on /v1/embeddings, an embedding
    model on a rerank route, a LoRA adapter of an LLM (`of`: that LLM), ...)."""

    def __init__(self, name: str, kind: str, wanted: str, *, of: str | None = None):
        what = f"{_a(kind)} {kind} model" if of is None else f"a LoRA adapter of the {kind} model {of}"
        super().__init__(f"`model` {name} is {what}: this route needs {_a(wanted)} {wanted} model.")
        self.name, self.kind, self.wanted = name, kind, wanted


def _a(word: str) -> str:
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


class InputTooLong(ContextLengthExceeded):
    """Input `index` has more tokens than the model takes, and truncation was not asked for."""

    def __init__(self, index: int, tokens: int, limit: int):
        super().__init__(
            f"Input {index} has {tokens} tokens; the model takes at most {limit}.",
            input_tokens=tokens,
            max_new_tokens=0,
            max_total=limit,
            max_input=limit,
        )
        self.index = index


class TooManyInputs(InvalidRequest):
    def __init__(self, count: int, what: str):
        super().__init__(f"{count} {what} in one request; at most {MAX_INPUTS} are allowed.")
        self.count = count


class DimensionsUnsupported(InvalidRequest):
    """`dimensions` other than the model's own on a model not trained to be cut, or not one it allows."""

    def __init__(self, name: str, dimensions: int, dim: int, allowed: tuple[int, ...] | None):
        if allowed is None:
            why = f"model {name} does not support dimensions other than its own ({dim}): it is not a Matryoshka model"
        elif allowed:
            why = f"model {name} supports dimensions {', '.join(map(str, allowed))}"
        else:
            why = f"model {name} supports dimensions from 1 to {dim}"
        super().__init__(f"`dimensions` {dimensions} is not supported: {why}.")
        self.dimensions = dimensions


@dataclass(frozen=True)
class TextModel:
    """A ready embedding or reranker model."""

    service: ModelService
    runner: EmbeddingRunner | ClassifierRunner
    engine: OneShotModel

    @property
    def name(self) -> str:
        return self.service.name

    @property
    def max_length(self) -> int:
        return self.runner.max_length

    async def tokenize(
        self, texts: Sequence[str], pairs: Sequence[str] | None = None, *, truncate: bool, side: str = "right"
    ) -> list[TokenRow]:
        """Token rows (off the event loop); without `truncate`, `InputTooLong` for the first row longer
        than the model takes."""
        rows = await tokenizing(self.runner.tokenize, texts, pairs, truncate=truncate, side=side)
        for index, row in enumerate(rows):
            if len(row["input_ids"]) > self.max_length:
                raise InputTooLong(index, len(row["input_ids"]), self.max_length)
        return rows

    async def run(self, rows: Sequence[TokenRow], extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The runner's outputs for token rows (and per-row `extra` inputs), through the batcher."""
        from lmiserve.oneshot.text import TOKEN_TYPES, TOKENS

        size = max(self.engine.config.batch_size, CHUNK_ROWS)
        jobs = []
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            inputs = {TOKENS: _column([r[TOKENS] for r in part])}
            if part and TOKEN_TYPES in part[0]:
                inputs[TOKEN_TYPES] = _column([r[TOKEN_TYPES] for r in part])
            for key, value in (extra or {}).items():
                inputs[key] = value[start : start + size]
            jobs.append(asyncio.ensure_future(self.engine.submit(inputs)))
        try:
            results = await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return {key: np.concatenate([r[key] for r in results]) for key in results[0]}


def _column(values: list[list[int]]) -> np.ndarray:
    """An object array holding one token list per row (numpy would make equal-length lists 2-D)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def tokens_of(rows: Sequence[TokenRow]) -> int:
    return sum(len(r["input_ids"]) for r in rows)


def check_count(count: int, what: str) -> None:
    if count > MAX_INPUTS:
        raise TooManyInputs(count, what)


# ---- finding the model ---------------------------------------------------------------------------------


def text_model(service: ModelService, wanted: str) -> TextModel:
    """`service` as a `TextModel` of the `wanted` kind (`WrongModelKind` when it is another kind;
    ModelNotReady while it loads). How a request finds the service: server/lookup.py."""
    service.ready_engine()
    runner: Any = service.loaded
    if kind_of(service) != wanted or runner is None or service.engine is None:
        raise WrongModelKind(service.name, kind_of(service), wanted)
    return TextModel(service, runner, cast("OneShotModel", service.engine))


def kind_of(service: ModelService) -> str:
    """``embedding``, ``reranker``, or the service's own kind (llm, classifier, regression, torchscript)."""
    runner: Any = service.loaded
    if service.kind == "regression" and runner is not None and len(getattr(runner, "labels", ())) == 1:
        return RERANKER
    return service.kind


def only_of_kind(served: list[ModelService], wanted: str) -> ModelService:
    """The one served model of the `wanted` kind; with one model served that is of another kind, that
    one (the caller answers `WrongModelKind`)."""
    fits = [s for s in served if kind_of(s) == wanted]
    if not fits:
        if any(s.status == ModelService.PENDING and s.kind in (EMBEDDING, "classifier") for s in served):
            raise ModelNotReady("The model is not ready.")
        if len(served) == 1:
            fits = served
        else:
            raise ModelNotFound(f"No {wanted} model is served.")
    if len(fits) > 1:
        names = ", ".join(sorted(s.name for s in fits))
        raise ModelRequired(f"Several {wanted} models are served ({names}): name one in `model`.")
    return fits[0]


# ---- what the routes compute ------------------------------------------------------------------------------


def check_dimensions(model: TextModel, dimensions: int | None) -> None:
    """`DimensionsUnsupported` unless the model may be cut to `dimensions` (None: whole)."""
    runner = cast("EmbeddingRunner", model.runner)
    if dimensions is None or dimensions == runner.dim:
        return
    allowed = runner.matryoshka
    if allowed is None or (allowed and dimensions not in allowed) or not 0 < dimensions <= runner.dim:
        raise DimensionsUnsupported(model.name, dimensions, runner.dim, allowed)


async def embed(
    model: TextModel, rows: Sequence[TokenRow], *, normalize: bool, dimensions: int | None = None
) -> np.ndarray:
    """FP32 [rows, dim] (or [rows, dimensions]); `check_dimensions` first."""
    from lmiserve.oneshot.text import NORMALIZE

    runner = cast("EmbeddingRunner", model.runner)
    cut = dimensions is not None and dimensions != runner.dim
    flags = np.full(len(rows), normalize and not cut, dtype=bool)
    vectors = (await model.run(rows, {NORMALIZE: flags}))["embedding"]
    if cut:
        vectors = vectors[:, :dimensions]
        if normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
    return np.ascontiguousarray(vectors, dtype=np.float32)


async def scores(model: TextModel, rows: Sequence[TokenRow]) -> np.ndarray:
    """The raw logit of each (query, document) row, FP32 [rows]."""
    return np.asarray((await model.run(rows))["score"], dtype=np.float32)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)


def activated(model: TextModel, logits: np.ndarray) -> np.ndarray:
    """The model's own scores: its CrossEncoder activation (sigmoid by default) on the logits."""
    activation = getattr(model.runner, "activation", "sigmoid")
    return logits if activation == "identity" else sigmoid(logits)


def pairs_of(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one against many (a string, or a list of one), or many against as many."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise InvalidRequest("`text_1` and `text_2` must not be empty.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequest(
            f"`text_1` has {len(first)} texts and `text_2` {len(second)}: give one text_1, or as many as text_2."
        )
    return list(zip(first, second))
