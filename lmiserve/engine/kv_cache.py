"""A preallocated, slot-addressed key/value cache for continuous batching.

Every running sequence owns one slot (a row of the cache). Active sequences are kept in the
lowest slots ``0..n-1`` so a decode step reads the cache through plain views, with no gather copy.
The model writes through :meth:`SlotKVCache.update`, the one method transformers' attention layers
call on a cache; what a forward pass writes where is set beforehand with :meth:`for_decode` or
:meth:`for_prefill`. The length dimension grows by doubling when a sequence outgrows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


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


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
        max_len: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_slots, num_kv_heads, initial_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._mode: str | None = None
        self._rows = 0
        self._positions: torch.Tensor | None = None
        self._span = 0
        self._slot = 0
        self._start = 0

    # ---- sizing -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def ensure_capacity(self, length: int) -> None:
        """Grow the length dimension (doubling) so every slot can hold `length` positions."""
        if length <= self.capacity:
            return
        new_len = self.capacity
        while new_len < length:
            new_len *= 2
        if self.max_len is not None:
            new_len = min(max(new_len, length), max(self.max_len, length))
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_zeros(old.shape[0], old.shape[1], new_len, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                store[i] = grown

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (slot compaction)."""
        if src == dst or length == 0:
            return
        for store in (self.keys, self.values):
            for layer in store:
                layer[dst, :, :length] = layer[src, :, :length]

    # ---- what the next forward pass writes ------------------------------------------------------
    def for_decode(self, positions: torch.Tensor) -> None:
        """Next forward: one new token for each slot 0..len(positions)-1, written at `positions`."""
        self._mode = "decode"
        self._rows = int(positions.shape[0])
        self._positions = positions
        self._span = int(positions.max().item()) + 1
        self.ensure_capacity(self._span)

    def for_prefill(self, slot: int, start: int, length: int) -> None:
        """Next forward: `length` prompt tokens of `slot`, written from position `start`."""
        self._mode = "prefill"
        self._slot = slot
        self._start = start
        self._span = start + length
        self.ensure_capacity(self._span)

    # ---- the cache protocol transformers calls --------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "decode":
            rows = torch.arange(self._rows, device=keys.device)
            keys[rows, :, self._positions] = key_states[:, :, 0]
            values[rows, :, self._positions] = value_states[:, :, 0]
            return keys[: self._rows, :, : self._span], values[: self._rows, :, : self._span]
        if self._mode == "prefill":
            s, a, b = self._slot, self._start, self._span
            keys[s, :, a:b] = key_states[0]
            values[s, :, a:b] = value_states[0]
            return keys[s : s + 1, :, :b], values[s : s + 1, :, :b]
        raise RuntimeError("SlotKVCache.update called without for_decode/for_prefill")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._span

    def __len__(self) -> int:
        return self.num_layers
