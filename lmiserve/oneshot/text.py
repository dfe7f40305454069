"""One-shot text models on transformers encoders: sentence embeddings and sequence classification.

Both take the BYTES input `text` (OneShotModel has checked the names), one text per row, tokenize a
batch with padding and truncation, and run one forward pass.

- `EmbeddingRunner` -> `embedding` FP32 [rows, dim]: token states pooled as the sentence-transformers
  config says (mean over non-padding tokens, CLS token, max, mean * sqrt(len), last token), then
  L2-normalised when the pipeline has a Normalize module.
- `ClassifierRunner` -> classification: `label` BYTES [rows] (id2label of the best class) and
  `probabilities` FP32 [rows, num_labels] (softmax; sigmoid for multi-label models);
  regression (one label): `score` FP32 [rows] (the raw head output).

The text routes (OpenAI's /v1/embeddings, TEI's /embed and /rerank, the rerank and score routes) hand
the same runners rows they tokenized themselves (`tokenize`: truncation on either side, or none, and
(query, document) pairs), as the internal inputs `input_ids` (and `token_type_ids` for pairs): object
arrays of one token-id list per row, padded here. An embedding batch of token rows also carries
`normalize` BOOL [rows] (L2-normalise that row or not) and answers the `embedding` of each row; a
classifier batch answers what the text rows do. The tensor protocols never reach these inputs (they
are not in the signature, and `OneShotModel.infer` checks the names).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmiserve.core.tensor_io import bytes_column, model_input, text_rows
from lmiserve.core.tensors import ModelSignature, TensorRequest, TensorSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TEXT = "text"
TOKENS = "input_ids"  # pre-tokenized rows (internal input of the text routes)
TOKEN_TYPES = "token_type_ids"  # their segment ids (pairs)
NORMALIZE = "normalize"  # BOOL [rows]: L2-normalise each embedding row or not
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = False


class _TextRunner:
    kind = ""
    signature: ModelSignature

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        path: Path,
        device: torch.device,
        max_length: int,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.device = device
        self.max_length = max_length
        # the tokenizer's truncation side is state: whoever tokenizes holds this lock
        self._tokenizer_lock = threading.Lock()

    def tokenize(
        self, texts: Sequence[str], pairs: Sequence[str] | None = None, *, truncate: bool, side: str = "right"
    ) -> list[dict[str, list[int]]]:
        """Token ids (and segment ids for `pairs`) of each text, or of each (text, pair) pair, with the
        model's special tokens; cut to `max_length` from `side` (``right`` or ``left``) when `truncate`,
        else whole (the caller checks the length)."""
        with self._tokenizer_lock:
            before = self.tokenizer.truncation_side
            self.tokenizer.truncation_side = side
            try:
                encoded = self.tokenizer(
                    list(texts),
                    list(pairs) if pairs is not None else None,
                    truncation=truncate,
                    max_length=self.max_length if truncate else None,
                    return_attention_mask=False,
                    verbose=False,
                )
            finally:
                self.tokenizer.truncation_side = before
        keys = [k for k in (TOKENS, TOKEN_TYPES) if k in encoded and (k == TOKENS or pairs is not None)]
        return [{k: list(encoded[k][i]) for k in keys} for i in range(len(texts))]

    def prepare(self, request: TensorRequest) -> dict[str, np.ndarray]:
        rows = text_rows(model_input(request, self.signature, TEXT, ""), TEXT)
        column = np.empty(len(rows), dtype=object)
        column[:] = rows
        return {TEXT: column}

    def _encode(self, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if TOKENS in inputs:  # rows tokenized by `tokenize`
            rows = [{TOKENS: list(ids)} for ids in inputs[TOKENS]]
            if TOKEN_TYPES in inputs:
                for row, types in zip(rows, inputs[TOKEN_TYPES]):
                    row[TOKEN_TYPES] = list(types)
            batch = self.tokenizer.pad(rows, padding=True, return_tensors="pt", return_attention_mask=True)
        else:
            with self._tokenizer_lock:
                batch = self.tokenizer(
                    [str(t) for t in inputs[TEXT]],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
        return {k: v.to(self.device) for k, v in batch.items()}


class EmbeddingRunner(_TextRunner):
    kind = "embedding"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        pooling: Pooling,
        dim: int,
        path: Path,
        device: torch.device,
        max_length: int,
        matryoshka: Sequence[int] | None = None,
        prompts: Mapping[str, str] | None = None,
    ) -> None:
        """`matryoshka`: the model may be cut to its first N dimensions (Matryoshka training): to one of
        these N, or to any N up to `dim` when the sequence is empty; None: it may not. `prompts`: the
        sentence-transformers prompts by name (TEI's `prompt_name` puts one before the text)."""
        super().__init__(model, tokenizer, path=path, device=device, max_length=max_length)
        self.pooling = pooling
        self.dim = dim
        self.matryoshka = tuple(matryoshka) if matryoshka is not None else None
        self.prompts = dict(prompts or {})
        self.signature = ModelSignature(
            inputs=(TensorSpec(TEXT, "BYTES", (-1,)),),
            outputs=(TensorSpec("embedding", "FP32", (-1, dim)),),
        )

    @torch.inference_mode()
    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = self._encode(inputs)
        states = self.model(**batch).last_hidden_state
        pooled = pool(states, batch["attention_mask"], self.pooling.mode)
        if NORMALIZE in inputs:  # token rows: each says whether it is normalised
            rows = torch.as_tensor(inputs[NORMALIZE].astype(bool), device=pooled.device).unsqueeze(1)
            pooled = torch.where(rows, torch.nn.functional.normalize(pooled, p=2, dim=1), pooled)
        elif self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return {"embedding": pooled.float().cpu().numpy()}


def pool(states: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[batch, tokens, dim] token states -> [batch, dim], ignoring padding (mask == 0)."""
    weights = mask.unsqueeze(-1).to(states.dtype)
    if mode == "cls":
        return states[:, 0]
    if mode == "max":
        return states.masked_fill(weights == 0, torch.finfo(states.dtype).min).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1  # right padding
        return states[torch.arange(states.shape[0], device=states.device), last]
    summed = (states * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


class ClassifierRunner(_TextRunner):
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> None:
        """`kwargs`: `_TextRunner`'s (path, device, max_length)."""
        super().__init__(model, tokenizer, **kwargs)
        config = model.config
        id2label: Mapping[Any, str] = config.id2label or {}  # int keys once the config is loaded
        self.labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(config.num_labels or 0)]
        self.regression = config.num_labels == 1 or config.problem_type == "regression"
        self.multi_label = config.problem_type == "multi_label_classification"
        self.kind = "regression" if self.regression else "classifier"
        self.activation = _activation(config)
        text = (TensorSpec(TEXT, "BYTES", (-1,)),)
        outputs: tuple[TensorSpec, ...]
        if self.regression:
            outputs = (TensorSpec("score", "FP32", (-1,)),)
        else:
            outputs = (TensorSpec("label", "BYTES", (-1,)), TensorSpec("probabilities", "FP32", (-1, len(self.labels))))
        self.signature = ModelSignature(inputs=text, outputs=outputs)

    @torch.inference_mode()
    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = self.model(**self._encode(inputs)).logits.float()
        if self.regression:
            return {"score": logits[:, 0].cpu().numpy()}
        probs = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
        best = probs.argmax(dim=-1).tolist()
        return {"label": bytes_column([self.labels[i] for i in best]), "probabilities": probs.cpu().numpy()}


def _activation(config: Any) -> str:
    """What turns a one-label head's logit into a score: ``sigmoid`` (sentence-transformers' CrossEncoder
    default, and what rerankers are trained for) unless the model's sentence-transformers config names
    the identity (``"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}``)."""
    st = getattr(config, "sentence_transformers", None)
    named = str(st.get("activation_fn", "")) if isinstance(st, dict) else ""
    return "identity" if named.endswith("Identity") else "sigmoid"
