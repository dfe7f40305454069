"""The names transformers gives a checkpoint's tensors when it loads them into a model: its renamings of the
model's published format (`transformers.conversion_mapping`: LLaVA's and Gemma 3's ``language_model.model.layers.``
are the models' ``model.language_model.layers.``, the Qwen VLs' ``model.layers.`` and ``visual.`` theirs
``model.language_model.layers.`` and ``model.visual.``). A tensor-parallel rank reads a checkpoint by them
(engine/model/shard_checkpoint.py), and a LoRA adapter saved under the older names finds its modules by them
(engine/lora/adapters.py). The converters that merge a mixture of experts' matrices are not applied: their
readers do that work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["renamer"]


def renamer(model: Any) -> Callable[[str], str]:
    """A checkpoint tensor's name (``...weight``) as `model`'s parameters name it (itself where nothing renames it)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # (a transformers without the renamings: the names as stored)
        return _same
    renamings = [t for t in get_model_conversion_mapping(model, add_legacy=False) if isinstance(t, WeightRenaming)]
    if not renamings:
        return _same

    def rename(name: str) -> str:
        renamed: str = rename_source_key(name, renamings, [])[0]
        return renamed

    return rename


def _same(name: str) -> str:
    return name
