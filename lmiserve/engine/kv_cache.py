"""The shape of a model's KV cache, and its paged pool (engine/paged_attention.py's `PagedKVCache`) made
for a model: every attention layer's keys and values in blocks of `block_size` tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmiserve.engine.paged_attention import PagedKVCache

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class AttentionShape:
    """The attention dimensions of a model, which shape its KV cache."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: PreTrainedConfig) -> AttentionShape:
        cfg: Any = config  # the attribute names are the architecture's (transformers declares none of them)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(int(cfg.num_hidden_layers), heads, int(kv_heads), int(head_dim))


def paged_cache(model: PreTrainedModel, num_blocks: int, block_size: int) -> PagedKVCache:
    """A `PagedKVCache` of `num_blocks` blocks of `block_size` tokens shaped for `model`'s attention layers."""
    shape = AttentionShape.of(model.config)
    return PagedKVCache(shape.layers, num_blocks, block_size, shape.kv_heads, shape.head_dim, model.dtype, model.device)


def kv_bytes_per_block(model: PreTrainedModel, block_size: int) -> int:
    """The memory of one block of `model`'s KV (every layer, K and V, in the model's dtype)."""
    shape = AttentionShape.of(model.config)
    return PagedKVCache.bytes_per_block(shape.layers, block_size, shape.kv_heads, shape.head_dim, model.dtype)
