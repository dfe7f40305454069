"""The RoPE tables `FastLlama` reads: the cosine and the signed sine of every position a step has needed,
built with the model's own rotary module (so its scaling and its dtype's rounding are transformers'), one
table per kind of layer where the model has several (Gemma 3's local and global layers:
`layout_variants.rope_kinds`).

A table is ``[positions, kinds, rotary_dim]``: the rows of a step's positions are ``[T, kinds, rotary_dim]``,
and a layer's are its kind's ``[T, 1, rotary_dim]`` (the shape that broadcasts over the heads). The rotary
width is a head's, or its first part (Phi-4-mini's ``partial_rotary_factor``: the rest of the head passes
unrotated). The sine's first half is negated, folding `rotate_half`'s sign into the table
(`layer_ops.rotate`).

**LongRoPE** (Phi-3.5-mini, Phi-3-mini-128k, Phi-4-mini): transformers' module takes the short factors in a
call whose positions stay within ``original_max_position_embeddings``, the long ones past it, whatever the
earlier tokens were rotated with. Here the choice is made once, from the context the engine serves (the
model's), as vLLM makes it from its ``max_model_len`` (its PR 27431): the short factors when the context is
within the original length (a table exactly transformers'), the long ones for every position otherwise
(transformers' for any call reaching past it).

**GLM** rotates pairs of neighbours, ``(2i, 2i + 1)``, not the two halves of the rotary width: its tables repeat
each frequency twice, the sine's even columns negated (`layer_ops.rotate` with ``pairs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lmiserve.engine.model.layout_variants import INTERLEAVED_ROPE_TYPES, rope_kinds


class RopeTables:
    def __init__(
        self,
        rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        kinds: tuple[str | None, ...],
        rotary_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int,
        long_past: int | None = None,
        interleaved: bool = False,
    ) -> None:
        """`rotary`: the model's rotary module (called with a kind of layer where `kinds` names them);
        `long_past`: a LongRoPE model's original length, when every position takes the long factors;
        `interleaved`: GLM's RoPE by pairs (2i, 2i + 1), its tables repeating each frequency twice."""
        self._rotary, self.kinds, self.rotary_dim, self.interleaved = rotary, kinds, rotary_dim, interleaved
        self._dtype, self._device, self._max_context, self._long_past = dtype, device, max_context, long_past
        self.cos = self.sin = torch.empty(0, len(kinds), rotary_dim, dtype=dtype, device=device)

    @classmethod
    def of(cls, model: Any, head_dim: int, max_context: int) -> tuple[RopeTables, list[int]]:
        """`model`'s tables for a served context of `max_context` positions, and each layer's kind among them."""
        config = model.config
        parameters = getattr(config, "rope_parameters", None) or {}
        partial = getattr(config, "partial_rotary_factor", None) or parameters.get("partial_rotary_factor") or 1.0
        rotary = model.model.rotary_emb
        original = parameters.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        original = int(original or 0)
        long = getattr(rotary, "rope_type", None) == "longrope" and 0 < original < max_context
        kinds, layer_kinds = rope_kinds(model)
        tables = cls(
            rotary, kinds, int(head_dim * partial), model.dtype, model.device, max_context,
            long_past=original if long else None, interleaved=config.model_type in INTERLEAVED_ROPE_TYPES,
        )  # fmt: skip
        return tables, layer_kinds

    def rows_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``[n, kinds, rotary_dim]`` (cos, signed sin) of positions the rotary module takes as they are,
        on the device: M-RoPE's ``[3, n]`` (an image's tokens, whose three positions differ), made as transformers
        makes them for its forward."""
        return self._rows(positions[:, None])

    def upto(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables (cos, signed sin), grown to cover positions ``0..positions-1`` (at least doubling, up to
        the model's context, so a growing sequence rebuilds them rarely)."""
        have = self.cos.shape[0]
        if positions > have:
            new = max(positions, min(max(2 * have, 256), max(self._max_context, positions)))
            ids = torch.arange(have, new, device=self._device)
            if self._long_past is not None:  # a last position past the original length: the long factors
                ids = torch.cat([ids, ids.new_tensor([max(self._long_past, new)])])
            cos, sin = self._rows(ids[None])
            self.cos = torch.cat([self.cos, cos[: new - have]])
            self.sin = torch.cat([self.sin, sin[: new - have]])
        return self.cos, self.sin

    def _rows(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, kinds, rotary_dim]`` (cos, signed sin) of the rotary module's call on `position_ids` (batch 1),
        each kind's: the sine's first half negated or (GLM's, `interleaved`) its even columns, after each
        frequency of the first half is repeated twice."""
        probe = torch.empty(0, dtype=self._dtype, device=self._device)
        half = self.rotary_dim // 2
        cos, sin = [], []
        for kind in self.kinds:
            c, s = self._rotary(probe, position_ids) if kind is None else self._rotary(probe, position_ids, kind)
            c, s = c[0], s[0]
            if c.shape[-1] == half:  # (gpt-oss's module gives each frequency once: both halves rotate by it)
                c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
            if self.interleaved:  # (transformers' GLM: each frequency of the first half, twice)
                c, s = c[:, :half].repeat_interleave(2, dim=-1), s[:, :half].repeat_interleave(2, dim=-1)
                cos.append(c)
                sin.append(torch.stack((-s[:, 0::2], s[:, 1::2]), dim=-1).flatten(-2))
                continue
            cos.append(c)
            sin.append(torch.cat((-s[:, :half], s[:, half:]), dim=-1))
        return torch.stack(cos, dim=1), torch.stack(sin, dim=1)
