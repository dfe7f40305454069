"""Which attention implementation transformers builds a model with: SDPA where the architecture has it (the
generic runner's paged attention and transformers' own forwards run it), else the architecture's default."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def sdpa_or_default(path: Path, make: Callable[..., PreTrainedModel]) -> PreTrainedModel:
    """`make(attn_implementation="sdpa")`, or `make()` (the architecture's default attention) where the model
    does not implement SDPA (Gemma 2, some remote-code models)."""
    try:
        return make(attn_implementation="sdpa")
    except ValueError as exc:
        message = str(exc).lower()  # transformers names it "sdpa" or "scaled_dot_product_attention" (Gemma 2)
        if "sdpa" not in message and "scaled_dot_product_attention" not in message:
            raise
        logger.warning("%s does not support SDPA attention; using its default attention", path)
        return make()
