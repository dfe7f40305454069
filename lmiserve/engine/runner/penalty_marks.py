"""A penalty book's marks on a CPU (runner/penalties.py): each penalized request's distinct tokens (prompt and
output) and its output's counts in host arrays, grown a token at a time, and a step's penalties from them,
indexed in place: on a CPU an op over a whole row of the vocabulary, or its `nonzero`, costs more than the
pairs a row marks (a GPU keeps dense rows instead). The values are the lists' (`penalties._from_lists`), bit
for bit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.host_copy import to_device

__all__ = ["Marks", "from_marks"]


class _Growing:
    """A numpy array appended to a value at a time (its capacity doubles)."""

    def __init__(self, dtype: type) -> None:
        self.values: np.ndarray = np.empty(16, dtype=dtype)
        self.size = 0

    def append(self, value: float) -> None:
        if self.size == len(self.values):
            self.values = np.concatenate((self.values, np.empty_like(self.values)))
        self.values[self.size] = value
        self.size += 1

    def view(self) -> np.ndarray:
        return self.values[: self.size]


@dataclass
class Marks:
    """A request's tokens on a CPU's path: its distinct tokens (prompt and output), its output's counts."""

    seen: set[int] = field(default_factory=set)
    seen_ids: _Growing = field(default_factory=lambda: _Growing(np.int64))
    where: dict[int, int] = field(default_factory=dict)  # an output token's place in the counts
    count_ids: _Growing = field(default_factory=lambda: _Growing(np.int64))
    count_values: _Growing = field(default_factory=lambda: _Growing(np.float32))

    def take(self, tokens: Sequence[int], width: int, output: bool) -> None:
        """`tokens` (the prompt's, or the output's new ones) marked, those past `width` left out."""
        for token in tokens:
            if not 0 <= token < width:
                continue
            if token not in self.seen:
                self.seen.add(token)
                self.seen_ids.append(token)
            if output:
                at = self.where.get(token)
                if at is None:
                    self.where[token] = self.count_ids.size
                    self.count_ids.append(token)
                    self.count_values.append(1.0)
                else:
                    self.count_values.values[at] += 1.0


def from_marks(base: torch.Tensor, at: list[int], params: list[SamplingParams], marks: list[Marks]) -> None:
    """The rows `at` of `base` penalized from each request's marks on the host: the (row, token) pairs of
    `_from_lists`, without making them again."""

    def pairs(per_row: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.repeat(np.asarray(at, dtype=np.int64), [len(ids) for ids in per_row])
        return to_device(rows, base.device), to_device(np.concatenate(per_row), base.device)

    def values(per_row: list[float], lengths: list[int]) -> torch.Tensor:  # (rounded once, as `_from_lists`)
        return to_device(
            torch.from_numpy(np.repeat(np.asarray(per_row, dtype=np.float64), lengths)).to(base.dtype), base.device
        )

    empty = np.empty(0, dtype=np.int64)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [m.seen_ids.view() if p.repetition_penalty != 1.0 else empty for p, m in zip(params, marks)]
        where = pairs(seen)
        penalty = values([p.repetition_penalty for p in params], [len(ids) for ids in seen])
        scores = base[where]
        base[where] = torch.where(scores > 0, scores / penalty, scores * penalty)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        on = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        ids = [m.count_ids.view() if o else empty for m, o in zip(marks, on)]
        lengths = [len(i) for i in ids]
        counts = np.concatenate([m.count_values.view() if o else np.empty(0, np.float32) for m, o in zip(marks, on)])
        where = pairs(ids)
        presence = values([p.presence_penalty for p in params], lengths)
        frequency = values([p.frequency_penalty for p in params], lengths)
        base[where] -= presence + frequency * to_device(counts, base.device).to(base.dtype)
