"""Engine events grouped into finished sequences, as the protocols' whole answers list them: in the
engine's order (ranked `n`/`best_of` answers come best first; the engine holds the one ranking rule)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lmiserve.core.events import Finish, StepEvent, Token


@dataclass
class GeneratedSequence:
    """One generated sequence collected from its events (not the engine's `Sequence`: what a protocol
    answers of one)."""

    tokens: list[Token]
    top_tokens: list[tuple[Token, ...]]
    finish: Finish


def sequences(events: Iterable[StepEvent]) -> list[GeneratedSequence]:
    """The finished sequences in event index order (the engine's: best first when it ranked them); a
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
    return [GeneratedSequence(by_index[i][0], by_index[i][1], finishes[i]) for i in sorted(finishes)]
