"""Engine events grouped into finished sequences, as both protocols' whole answers list them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lmiserve.core.events import Finish, StepEvent, Token


@dataclass
class Sequence:
    """One generated sequence collected from its events."""

    tokens: list[Token]
    top_tokens: list[tuple[Token, ...]]
    finish: Finish

    @property
    def mean_logprob(self) -> float:
        lps = [t.logprob for t in self.tokens if t.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")


def sequences(events: Iterable[StepEvent]) -> list[Sequence]:
    """The finished sequences (by event index), the best (highest mean token logprob) first; a
    sequence without a finish event is left out."""
    by_index: dict[int, tuple[list, list]] = {}
    finishes: dict[int, Finish] = {}
    for event in events:
        tokens, tops = by_index.setdefault(event.index, ([], []))
        if event.token is not None:
            tokens.append(event.token)
            tops.append(event.top_tokens or ())
        if event.finish is not None:
            finishes[event.index] = event.finish
    seqs = [Sequence(by_index[i][0], by_index[i][1], finishes[i]) for i in sorted(finishes)]
    return sorted(seqs, key=lambda s: s.mean_logprob, reverse=True)
