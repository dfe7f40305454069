"""A loaded causal LM as the engine receives it (models/load.py builds it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """A model in eval mode on `device` plus what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: set[int]
    name: str
    path: Path
    # A vision-language model's processor (transformers' ProcessorMixin: image processor + `tokenizer` +
    # the expansion of image placeholders into image tokens); None: a text model.
    processor: Any | None = None
