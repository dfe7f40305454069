"""One step of the fast forward (engine/model/fast_llama.py), `StepInputs`, and what that forward asks of
the decode steps captured as CUDA graphs, `DecodeReplay` (engine/attention/cuda_graphs.py's `DecodeGraphs`,
which builds on the forward: the forward never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lmiserve.engine.lora.batch import LoraBatch

__all__ = ["DecodeReplay", "StepInputs"]


class DecodeReplay(Protocol):
    """What the forward asks of the decode steps captured as CUDA graphs (engine/attention/cuda_graphs.py's
    `DecodeGraphs`, which builds on this module: this one never imports it)."""

    def covers(self, rows: int, lora: LoraBatch | None) -> bool:
        """A step of `rows` decode rows (with the adapters `lora`) replays a captured graph."""
        ...

    def run(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        lora: LoraBatch | None,
        sources: Sequence[int] | None,
        shifts: Sequence[int] | None,
    ) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab]`` of a step of decode rows (`sources`, `shifts`: `StepInputs`')."""
        ...

    def run_folded(self, step: StepInputs) -> torch.Tensor | None:
        """The kept logits of a step with prompt chunks replayed with each chunk token a row; None if not."""
        ...


@dataclass
class StepInputs:
    """One step of the fast forward. Tokens are ordered: the decode rows (row i: token `decode_ids[i]` at
    `decode_positions[i]`, its block table `decode_tables[i]`), then each prompt chunk ``(block table,
    start, token ids)`` in turn; `keep`: the flattened token rows whose logits are returned; `lora`: the
    adapters of the tokens (engine/lora/adapters.py, groups named by `FastLlama.lora_groups`);
    `decode_sources`: for each decode row, the row of the last decode graph's step whose greedy token is its
    input, on the device (-1: `decode_ids`'; only a step the graphs replay); `embeds`: a vision-language model's
    image features, ``(token rows, features)`` (both on the device): the flattened token rows whose embeddings
    they replace (their ids are any in the vocabulary), and a ``[rows, hidden]`` feature row for each;
    `rope_shifts`: each row's RoPE shift (decode rows, then chunks; None: none), the position its tokens are
    rotated at less their position (M-RoPE's text past an image: runner/vision_fast.py); `rope_rows`: RoPE table
    rows that replace some tokens' ``(token rows, cos rows, signed sin rows)`` on the device (M-RoPE's image
    tokens, whose three positions differ: `RopeTables.rows_at`); `deepstack`: Qwen3-VL's DeepStack features, one
    ``[rows, hidden]`` a layer of its first layers, added to `embeds`' token rows after that layer; `opens`: for
    each prompt chunk, the spans of its positions whose tokens see each other both ways (Gemma 3's images:
    `SeqTokens.opens`; None: none in the step)."""

    decode_ids: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    chunks: list[tuple[list[int], int, list[int]]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    lora: LoraBatch | None = None
    decode_sources: list[int] | None = None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_shifts: list[int] | None = None
    rope_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    deepstack: list[torch.Tensor] | None = None
    opens: list[tuple[tuple[int, int], ...]] | None = None

    def tokens(self) -> tuple[list[int], list[int]]:
        """The step's token ids and their positions, in its token order (new lists)."""
        ids = self.decode_ids + [t for _, _, chunk in self.chunks for t in chunk]
        positions = list(self.decode_positions)
        for _, start, chunk in self.chunks:
            positions.extend(range(start, start + len(chunk)))
        return ids, positions

    def replayed(self) -> tuple[Any, ...]:
        """The decode rows' ids, positions, tables, adapters, sources and shifts: `DecodeReplay.run`'s arguments."""
        decode = (self.decode_ids, self.decode_positions, self.decode_tables)
        return (*decode, self.lora, self.decode_sources, self.rope_shifts)

    def token_shifts(self) -> list[int] | None:
        """Each token's RoPE shift, in `tokens`' order (None: none)."""
        if self.rope_shifts is None:
            return None
        counts = [1] * len(self.decode_ids) + [len(chunk) for _, _, chunk in self.chunks]
        return [shift for shift, count in zip(self.rope_shifts, counts, strict=True) for _ in range(count)]
