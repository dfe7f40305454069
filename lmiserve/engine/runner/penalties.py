"""The penalties of a step's rows (runner/sampling.py's `_processed_rows`): repetition (multiplicative over the
prompt's and the output's tokens: a positive logit divided by it, a negative one multiplied), presence and
frequency (additive over the output's tokens, OpenAI's definition: ``presence + frequency * count``).

A persistent batch's runner keeps each penalized request's tokens in a `PenaltyBook`, taken once for the
prompt and then token by token as the output grows, so that a step's penalties cost what its rows are, not
what their contexts hold:

- on a GPU, as dense device rows ``[slots, vocab]``: the tokens a request's prompt and output hold, and its
  counts of output tokens, marked by one indexed op for the step's new tokens; a step's penalties are a few
  ops over its penalized rows, nothing copied but their slots (vLLM counts the output tokens into a
  ``[rows, vocab]`` table each step);
- on a CPU, as each request's distinct tokens and its output's counts in host arrays, grown a token at a
  time; a step's penalties index those arrays in place (runner/penalty_marks.py: on a CPU an op over a
  whole row of the vocabulary, or its `nonzero`, costs more than the pairs a row marks).

A decode graph reads the dense rows too, pinned for it (`pin`), and marks its rows' input tokens there
(runner/graph_sampling.py: `flush`'s `upto`, `taken_by_graph`).

Rows without a book (`sampling.sample_row`'s callers) still give the (row, token) pairs of their set of
tokens from the request's lists, made again each step: at 128 rows of 1,024 tokens, ~390,000 values made on
the host and copied to the device a step (benchmarks/results/issue39-penalty-book-2026-12-01/). Every path
gives the same values, bit for bit: the same float32 ops on the same elements.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.host_copy import row_pairs, row_values, to_device
from lmiserve.engine.runner.penalty_marks import Marks, from_marks

__all__ = ["FIRST_SLOTS", "BookedRow", "PenaltyBook", "dense_penalized", "penalize", "penalized"]

FIRST_SLOTS = 8  # the dense rows' first size in requests; they double as more are penalized at once


def penalized(params: SamplingParams) -> bool:
    """Whether a request with `params` sets a repetition, presence or frequency penalty."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


@dataclass
class _Tracked:
    """A request's lists, and what the book took of them: into its `marks` (a CPU's), or its dense rows."""

    prompt_ids: list[int]
    output_ids: list[int]  # the request's own list, appended to as its tokens come
    counted: int = 0  # how many of `output_ids` the book took
    fresh: bool = True  # its prompt not yet taken (and, dense, its rows not yet cleared)
    marks: Marks | None = None  # the CPU's path: made at its first flush


class PenaltyBook:
    """Each open request's tokens, one slot a request from `open` to `close`, following the request's lists:
    `flush` takes what they gained since (a step's tokens, from any path: a graph's pick received, the eager
    sampler, a draft verified). On the dense path (`_dense`: a GPU) they are device rows ``[slots, vocab]``,
    `seen` (bool: the prompt's and the output's tokens, for the repetition penalty) and `counts` (float32: the
    output's tokens, for presence and frequency), made at the first flush on the logits' device and width,
    grown by doubling, and let go when no request is open; else each request's marks on the host."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (a CPU samples rows on several threads, runner/row_threads.py)
        self._open: dict[int, _Tracked] = {}
        self._free: list[int] = []
        self._next = 0  # slots below it were handed out once
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self._kind: tuple[torch.device, int] | None = None  # the device and width the marks were taken for
        self.pinned = False  # a decode graph reads the dense rows (`pin`)
        self._least = 0  # the requests the pinned rows hold at least
        self.version = 0  # counts the dense rows' allocations (a graph that read older ones is captured again)

    def open(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A slot for a request whose tokens are these lists (`output_ids` is read again at each flush)."""
        with self._lock:
            slot = self._free.pop() if self._free else self._next
            self._next = max(self._next, slot + 1)
            self._open[slot] = _Tracked(prompt_ids, output_ids)
            return slot

    def close(self, slot: int) -> None:
        """The request of `slot` is gone (finished, or replaced); with none open, the dense rows are let go."""
        with self._lock:
            if self._open.pop(slot, None) is None:
                return
            self._free.append(slot)
            if not self._open:
                self._free, self._next = [], 0
                if not self.pinned:
                    self.seen, self.counts = None, None

    def __len__(self) -> int:
        """The requests open."""
        return len(self._open)

    @staticmethod
    def dense(device: torch.device) -> bool:
        """Whether the book keeps dense rows for logits on `device` (which a decode graph reads)."""
        return _dense(device)

    def pin(self, least: int = 0) -> None:
        """From now on the dense rows stay (a decode graph captured their addresses: runner/graph_sampling.py),
        made for `least` requests at least (a step's most rows: no growth as a batch fills up), with one row
        past the slots handed out, `scratch`, that the graph's rows without a penalty read and write; a new
        allocation (growth) changes `version`."""
        with self._lock:
            self.pinned, self._least = True, max(self._least, least)

    @property
    def scratch(self) -> int:
        """The pinned rows' last row: never a request's."""
        return self.slots - 1

    def taken(self, slot: int) -> int:
        """How many of the output's tokens of `slot` are marked (by `flush`, or by a graph: `taken_by_graph`)."""
        return self._open[slot].counted

    def taken_by_graph(self, slots: list[int]) -> None:
        """A decode graph marked the next output token of each of `slots` in the dense rows (its input token)."""
        with self._lock:
            for slot in slots:
                self._open[slot].counted += 1

    @property
    def slots(self) -> int:
        """The slots the dense rows hold (0 on the sparse path, before the first flush, or once every request
        closed)."""
        return 0 if self.counts is None else len(self.counts)

    def marks(self, slot: int) -> Marks:
        """The CPU path's marks of `slot` (taken by `flush`)."""
        marks = self._open[slot].marks
        assert marks is not None, "flushed on the sparse path first"
        return marks

    def flush(self, device: torch.device, width: int, slots: list[int], upto: list[int] | None = None) -> None:
        """Bring the marks of `slots` up to their requests' lists: a new request's prompt taken, the output
        tokens added since taken (dense: a new request's rows cleared first, then one indexed op each for
        them together), each slot's up to its output's `upto` tokens where given (dense only)."""
        with self._lock:
            if self._kind != (device, width):  # (another device or width: every request's marks taken again)
                self._kind, self.seen, self.counts = (device, width), None, None
                for slot, tracked in list(self._open.items()):
                    self._open[slot] = _Tracked(tracked.prompt_ids, tracked.output_ids)
            if _dense(device):
                self._flush_dense(device, width, slots, upto)
                return
            for slot in slots:
                tracked = self._open[slot]
                if tracked.marks is None:
                    tracked.marks = Marks()
                if tracked.fresh:
                    tracked.marks.take(tracked.prompt_ids, width, output=False)
                    tracked.fresh = False
                tracked.marks.take(tracked.output_ids[tracked.counted :], width, output=True)
                tracked.counted = len(tracked.output_ids)

    def _flush_dense(self, device: torch.device, width: int, slots: list[int], upto: list[int] | None) -> None:
        self._fit(device, width)
        assert self.seen is not None and self.counts is not None
        fresh: list[int] = []
        marks: tuple[list[int], list[int]] = ([], [])  # (slot, token) pairs: prompts' and outputs' tokens
        added: tuple[list[int], list[int]] = ([], [])  # outputs' tokens
        for n, slot in enumerate(slots):
            tracked = self._open[slot]
            if tracked.fresh:
                fresh.append(slot)
                ids = set(tracked.prompt_ids)
                marks[0].extend([slot] * len(ids))
                marks[1].extend(ids)
                tracked.fresh = False
            new = tracked.output_ids[tracked.counted : None if upto is None else upto[n]]
            if new:
                for pairs in (marks, added):
                    pairs[0].extend([slot] * len(new))
                    pairs[1].extend(new)
                tracked.counted += len(new)
        if fresh:
            at = to_device(fresh, device)
            self.seen.index_fill_(0, at, False)
            self.counts.index_fill_(0, at, 0.0)
        if marks[0]:
            self.seen.index_put_(self._pairs(marks, device, width), torch.tensor(True, device=device))
        if added[0]:
            where = self._pairs(added, device, width)
            self.counts.index_put_(where, torch.ones(len(where[0]), device=device), accumulate=True)

    def _fit(self, device: torch.device, width: int) -> None:
        """Dense rows on `device`, `width` tokens wide, one for every slot handed out (pinned: and `scratch`)."""
        size, wanted = self.slots, max(self._next, self._least) + int(self.pinned)
        if size >= wanted and self.counts is not None:
            return
        grown = max(FIRST_SLOTS, size)
        while grown < wanted:
            grown *= 2
        if self.pinned and self._next <= self._least:  # (a step's most rows and the scratch row: no more)
            grown = max(size, wanted)
        self.version += 1
        seen = torch.zeros((grown, width), dtype=torch.bool, device=device)
        counts = torch.zeros((grown, width), dtype=torch.float32, device=device)
        if self.seen is not None and self.counts is not None:
            seen[:size], counts[:size] = self.seen, self.counts
        self.seen, self.counts = seen, counts

    @staticmethod
    def _pairs(pairs: tuple[list[int], list[int]], device: torch.device, width: int) -> tuple[torch.Tensor, ...]:
        slots, tokens = pairs
        if any(t < 0 or t >= width for t in tokens):  # (an id past the logits: no logit of it to penalize)
            kept = [(s, t) for s, t in zip(slots, tokens) if 0 <= t < width]
            slots, tokens = [s for s, _ in kept], [t for _, t in kept]
        return to_device(slots, device), to_device(tokens, device)


@dataclass(frozen=True)
class BookedRow:
    """A row whose request's tokens a `PenaltyBook` holds, at `slot`."""

    book: PenaltyBook
    slot: int


def penalize(
    base: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
    booked: Sequence[BookedRow | None],
) -> None:
    """`base`'s rows (one a row of the other arguments) penalized in place: the booked rows from their book,
    the others from their lists."""
    on_book = [j for j, (b, p) in enumerate(zip(booked, params)) if b is not None and penalized(p)]
    if on_book:
        rows = [booked[j] for j in on_book]
        book = rows[0].book  # type: ignore[union-attr]
        if any(b.book is not book for b in rows):  # type: ignore[union-attr]
            raise ValueError("a step's penalized rows are kept in one book")
        slots = [b.slot for b in rows]  # type: ignore[union-attr]
        book.flush(base.device, base.shape[-1], slots)
        chosen = [params[j] for j in on_book]
        if _dense(base.device):
            _from_rows(base, on_book, chosen, book, slots)
        else:
            from_marks(base, on_book, chosen, [book.marks(s) for s in slots])
    if len(on_book) < len(params):
        skip = set(on_book)
        _from_lists(base, [p if j not in skip else SamplingParams() for j, p in enumerate(params)], prompts, outputs)


def _dense(device: torch.device) -> bool:
    """Whether a book keeps dense device rows (a GPU: no count read on the host, a few launches a step) or
    each request's marks on the host (a CPU: `nonzero` is a host op there, and ops over a whole row of the
    vocabulary cost more than the pairs it marks)."""
    return device.type != "cpu"


def _column(base: torch.Tensor, values: list[float]) -> torch.Tensor:
    return to_device(values, base.device, base.dtype)[:, None]


def _from_rows(
    base: torch.Tensor, at: list[int], params: list[SamplingParams], book: PenaltyBook, slots: list[int]
) -> None:
    """The rows `at` of `base` penalized from the book's dense rows, ops over the whole rows."""
    assert book.seen is not None and book.counts is not None
    rows, where = to_device(at, base.device), to_device(slots, base.device)
    repeated = counted = None
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = book.seen.index_select(0, where)
        if any(r == 1.0 for r in repetition):
            seen &= to_device([r != 1.0 for r in repetition], base.device, torch.bool)[:, None]
        repeated = seen, _column(base, repetition)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        counts = book.counts.index_select(0, where).to(base.dtype)
        presence = _column(base, [p.presence_penalty for p in params])
        counted = counts, presence, _column(base, [p.frequency_penalty for p in params])
    base.index_copy_(0, rows, dense_penalized(base.index_select(0, rows), repeated, counted))


def dense_penalized(
    logits: torch.Tensor,
    repeated: tuple[torch.Tensor, torch.Tensor] | None = None,
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`logits` (rows of the vocabulary) penalized from their dense rows: `repeated`, where the repetition
    penalty applies (bool rows) and its column; `counted`, a copy of the output's counts in `logits`' dtype
    (which it overwrites) and the presence and frequency columns (None: no such penalty). A new tensor where
    either is given (a decode graph's rows too: runner/graph_sampling.py). The lists' ops (`_from_lists`), a
    few rows of the vocabulary held at once (as a graph's pick holds them: `pool_plan.GRAPH_LOGIT_BYTES`)."""
    if repeated is not None:
        seen, repetition = repeated
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits, out=penalized)
    if counted is not None:
        counts, presence, frequency = counted
        applies = counts > 0
        penalty = counts.mul_(frequency).add_(presence)  # (presence + frequency * counts: the same bits)
        penalized = logits - penalty
        del penalty, counts, counted
        logits = torch.where(applies, penalized, logits, out=penalized)
    return logits


def _from_lists(
    base: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[list[int]], outputs: Sequence[list[int]]
) -> None:
    """Each penalized row's (row, token) pairs, from its lists, in one indexed op a penalty."""
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [
            sorted(set(prompt) | set(output)) if p.repetition_penalty != 1.0 else []
            for p, prompt, output in zip(params, prompts, outputs)
        ]
        at = row_pairs(seen, base.device)
        penalty = row_values([[p.repetition_penalty] * len(ids) for p, ids in zip(params, seen)], base)
        scores = base[at]
        base[at] = torch.where(scores > 0, scores / penalty, scores * penalty)
    counts = [
        Counter(output) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 else Counter()
        for p, output in zip(params, outputs)
    ]
    if any(counts):
        at = row_pairs([list(c) for c in counts], base.device)
        presence = row_values([[p.presence_penalty] * len(c) for p, c in zip(params, counts)], base)
        frequency = row_values([[p.frequency_penalty] * len(c) for p, c in zip(params, counts)], base)
        base[at] -= presence + frequency * row_values([list(c.values()) for c in counts], base)
