"""The RoPE tables `FastLlama` reads: the cosine and the signed sine of every position a step has needed,
built with the model's own rotary module (so its scaling and its dtype's rounding are transformers'), one
table per kind of layer where the model has several (Gemma 3's local and global layers:
`layout_variants.rope_kinds`).

A table is ``[positions, kinds, head_dim]``: the rows of a step's positions are ``[T, kinds, head_dim]``, and
a layer's are its kind's ``[T, 1, head_dim]`` (the shape that broadcasts over the heads). The sine's first
half is negated, folding `rotate_half`'s sign into the table (`fast_llama._rotate`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class RopeTables:
    def __init__(
        self,
        rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        kinds: tuple[str | None, ...],
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int,
    ) -> None:
        """`rotary`: the model's rotary module (called with a kind of layer where `kinds` names them)."""
        self._rotary, self.kinds, self.head_dim = rotary, kinds, head_dim
        self._dtype, self._device, self._max_context = dtype, device, max_context
        self.cos = self.sin = torch.empty(0, len(kinds), head_dim, dtype=dtype, device=device)

    def upto(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables (cos, signed sin), grown to cover positions ``0..positions-1`` (at least doubling, up to
        the model's context, so a growing sequence rebuilds them rarely)."""
        have = self.cos.shape[0]
        if positions > have:
            new = max(positions, min(max(2 * have, 256), max(self._max_context, positions)))
            ids = torch.arange(have, new, device=self._device)[None]
            probe = torch.empty(0, dtype=self._dtype, device=self._device)
            half = self.head_dim // 2
            cos, sin = [], []
            for kind in self.kinds:
                c, s = self._rotary(probe, ids) if kind is None else self._rotary(probe, ids, kind)
                cos.append(c[0])
                sin.append(torch.cat((-s[0][:, :half], s[0][:, half:]), dim=-1))
            self.cos = torch.cat([self.cos, torch.stack(cos, dim=1)])
            self.sin = torch.cat([self.sin, torch.stack(sin, dim=1)])
        return self.cos, self.sin
