"""One-shot text models on transformers encoders: sentence embeddings and sequence classification.

Both take the BYTES input `text` (OneShotModel has checked the names), one text per row, tokenize a
batch with padding and truncation, and run one forward pass.

- `EmbeddingRunner` -> `embedding` FP32 [rows, dim]: token states pooled as the sentence-transformers
  config says (mean over non-padding tokens, CLS token, max, mean * sqrt(len), last token), then
  L2-normalised when the pipeline has a Normalize module.
- `ClassifierRunner` -> classification: `label` BYTES [rows] (id2label of the best class) and
  `probabilities` FP32 [rows, num_labels] (softmax; sigmoid for multi-label models);
  regression (one label): `score` FP32 [rows] (the raw head output).
"""

from __future__ import annotations

from collections.abc import Mapping
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

    def prepare(self, request: TensorRequest) -> dict[str, np.ndarray]:
        rows = text_rows(model_input(request, self.signature, TEXT, ""), TEXT)
        column = np.empty(len(rows), dtype=object)
        column[:] = rows
        return {TEXT: column}

    def _encode(self, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
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
    ) -> None:
        super().__init__(model, tokenizer, path=path, device=device, max_length=max_length)
        self.pooling = pooling
        self.signature = ModelSignature(
            inputs=(TensorSpec(TEXT, "BYTES", (-1,)),),
            outputs=(TensorSpec("embedding", "FP32", (-1, dim)),),
        )

    @torch.inference_mode()
    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = self._encode(inputs)
        states = self.model(**batch).last_hidden_state
        pooled = pool(states, batch["attention_mask"], self.pooling.mode)
        if self.pooling.normalize:
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
