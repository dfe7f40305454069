"""A decode graph's sampled rows: the step's sampling inside the CUDA graph too (issue #39: the whole decode
step captured, sampling included), so that a step of sampled rows replays one graph, sends its tokens in
the step's one transfer and chains into the next step on the device, as a greedy step does.

A row samples in the graph (`in_graph`) when it is greedy, or sampled with temperature, top_k (up to
`GRAPH_TOP_K`), top_p and min_p alone, either with a repetition, presence or frequency penalty or none, with
a `min_new_tokens` whose EOS and stop ids are at most `GRAPH_BANNED` or none, and a top-N of up to
`GRAPH_TOP_N` tokens: no logit bias, bad words or typical_p, which stay with the eager sampler
(runner/sampling.py) from the graph's logits: those rows alone, the step's others taking the graph's pick
(runner/persistent_batch.py, `_graph_served`), where a grammar's rows go too.

Until a row has its `min_new_tokens` (benchmark clients send vLLM's ``min_tokens = max_tokens`` with
``ignore_eos``), the graph bans its ids after the penalties, as the eager sampler does: the host writes them
each step with the add of each (-inf; 0 once the row has its tokens, so the graph is the same), and one
`scatter_add_` puts them on the processed logits. A greedy row that needs processing (a penalty, a ban) takes
the argmax of its processed logits, as the eager sampler's; a plain greedy row, its raw argmax.

A penalized row's graph reads its request's dense rows in the runner's `PenaltyBook` (runner/penalties.py,
pinned: fixed addresses), through the slot the graph's buffers give it (the rows without a penalty read the
book's scratch row, which changes nothing), and marks there its input token first: the request's last
output token, whichever path sampled it (a graph's pick chained on the device, or the eager sampler), so
the book's host side takes each output token up to the one before (`PenaltyBook.flush`'s `upto`) and counts
the graph's one (`taken_by_graph`) once the graph ran. The penalties are the eager dense path's ops
(`penalties.dense_penalized`); a greedy penalized row takes the argmax of its processed logits, as the
eager sampler does. A graph of such a step is its own kind (`PENALIZED`), captured again when the book's rows
were allocated anew (their growth past the slots pinned). Its parameters are device
buffers the graph reads (`GraphSampler`: written on the host, copied before the replay, as the graph's ids
and positions), and every stage runs for every row, a row that does not set it passing through unchanged:
the ops are the eager sampler's own (runner/warpers.py's stages, `seeded_draw.draw_keyed`), so a row gets
the token the eager GPU path gives it, bit for bit: its warped probabilities are its own alone, and its
draw is keyed by its seed and the index of the token (engine/runner/seeded_draw.py), whatever the graph's
other rows. Greedy rows take the argmax of their raw logits. The pick is ``[rows, 3]`` float64: the token,
its logprob (the raw logits' log-softmax, as every path reports it) and whether the row could not be drawn
from (the eager sampler's rule). A step with top-N rows adds each row's likeliest tokens of its raw
logits to the pick after the replay (`with_top_n`: the eager sampler's `topk`, on the device, no wait), so
those rows chain as the others do.

A step where no sampled row sets top_k, top_p or min_p (OpenAI's defaults) replays a graph without those
stages (`kind`: `SAMPLED`, not `FILTERED`), through which every row would pass unchanged: its rows get the
same tokens without the `topk` and the sort of the vocabulary a row, on a GPU the sampler's largest cost at
many rows (a table in vllm-project/vllm#40376 gives its PyTorch sort-based top-p 2.3 ms a step of 128 rows
of a 131k vocabulary), nor min_p's softmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner import seeded_draw
from lmiserve.engine.runner.penalties import PenaltyBook, dense_penalized, penalized
from lmiserve.engine.runner.sampling import needs_processing, processed_finite
from lmiserve.engine.runner.warpers import NEG_INF, finite, min_p_cut, scaled, top_k_columns, top_k_cut, top_p_cut

__all__ = [
    "FILTERED",
    "GRAPH_BANNED",
    "GRAPH_TOP_K",
    "GRAPH_TOP_N",
    "PENALIZED",
    "PENALTIES_IN_GRAPHS",
    "SAMPLED",
    "USE_IN_GRAPHS",
    "GraphRow",
    "GraphSampler",
    "in_graph",
    "kind",
    "stages",
    "with_top_n",
]

GRAPH_TOP_K = 1024  # the largest top_k a row sampled in a graph may set (the graph's `topk` is this wide)
GRAPH_TOP_N = 20  # the most top-N tokens a row takes from a graph's step (OpenAI's top_logprobs at most)
GRAPH_BANNED = 16  # the most ids a row's `min_new_tokens` bans in a graph (its EOS and stop ids)
USE_IN_GRAPHS = True  # False: a decode graph's sampled rows are sampled after it, from its logits
PENALTIES_IN_GRAPHS = True  # False: a penalized row is sampled after its decode graph, from its logits
SAMPLED, FILTERED = "sampled", "sampled-filtered"  # a sampled graph's kinds: without top_k, top_p, min_p; with
PENALIZED = "+penalized"  # a sampled kind's suffix: its rows' penalties too, read from the book
GraphRow = tuple[SamplingParams, int | None, int, int | None, Sequence[int]]  # a row a graph samples (`fill`)


def in_graph(params: SamplingParams, banned: int = 0) -> bool:
    """Whether a row with `params`, whose `min_new_tokens` bans `banned` ids, samples inside a decode graph
    (the module's doc)."""
    if params.top_n_tokens > GRAPH_TOP_N:
        return False
    if not needs_processing(params):
        return True  # plain greedy
    if penalized(params) and not PENALTIES_IN_GRAPHS:
        return False
    if params.logit_bias or params.bad_words_ids or banned > GRAPH_BANNED:
        return False
    return not params.do_sample or (params.typical_p >= 1.0 and params.top_k <= GRAPH_TOP_K)


def kind(params: Iterable[SamplingParams]) -> str:
    """The kind of sampled graph a step of rows with `params` (all `in_graph`) replays: `FILTERED` where a
    sampled row sets top_k, top_p or min_p, else `SAMPLED`; with `PENALIZED` after it where a row is
    penalized."""
    params = list(params)
    filtered = any(p.do_sample and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
    return (FILTERED if filtered else SAMPLED) + (PENALIZED if any(penalized(p) for p in params) else "")


def stages(kind: str) -> tuple[bool, bool]:
    """Whether a sampled graph of `kind` has the top_k, top_p and min_p stages, and the penalties."""
    return kind.startswith(FILTERED), kind.endswith(PENALIZED)


class GraphSampler:
    """The sampling parameters of a decode graph's rows, for up to `largest` rows: host buffers `fill` writes
    and copies over, and the device buffers `pick` reads (fixed addresses, which a captured graph keeps)."""

    def __init__(self, largest: int, vocab: int, device: torch.device, pin: bool) -> None:
        self.vocab, self.width = vocab, min(GRAPH_TOP_K, vocab)
        # floats: temperature, 1 - top_p, min_p, repetition, presence, frequency penalties;
        # ints: k - 1, top_k off, top_p on, seed key, token index, sampled, the book's slot, a greedy row's
        # token from its processed logits; the ids `min_new_tokens` bans (`GRAPH_BANNED` a row), and what
        # each adds to its logit: -inf (banned), 0 (none: id 0)
        self._host = (
            torch.ones((6, largest), dtype=torch.float32, pin_memory=pin),
            torch.zeros((8, largest), dtype=torch.int64, pin_memory=pin),
            torch.zeros((largest, GRAPH_BANNED), dtype=torch.int64, pin_memory=pin),
            torch.zeros((largest, GRAPH_BANNED), dtype=torch.float32, pin_memory=pin),
        )
        self._device = tuple(torch.zeros_like(t, device=device) for t in self._host)
        self._floats, self._ints, self._bans, self._banned = (t.numpy() for t in self._host)  # (numpy: no torch op)
        self.book: PenaltyBook | None = None  # whose dense rows a penalized graph reads (`fill`)
        self._version = 0  # the version of the book's rows that the penalized graphs captured read (`moved`)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # (a graph makes no tensor from the host)

    def fill(self, rows: Sequence[GraphRow], size: int, book: PenaltyBook | None = None) -> None:
        """The rows' ``(params, seed, index, slot, banned)`` (`index`: the tokens the row's sequence has, those
        of a step still in flight included; `slot`: a penalized row's in `book`, pinned and flushed; `banned`:
        the ids its `min_new_tokens` bans at this token, none once it has them), padded to `size` greedy rows,
        copied to the device without a wait."""
        scratch = book.scratch if book is not None and book.pinned else 0
        floats, ints = [], []
        banning: dict[tuple[int, ...], list[int]] = {}  # the rows of each list of ids (most share one)
        for n, (params, seed, index, slot, banned) in enumerate(rows):
            row_floats, row_ints = [1.0, 0.0, 0.0], [0, 1, 0, 0, 0, 0]  # greedy: every stage off
            if params.do_sample:
                k = params.top_k if 0 < params.top_k < self.vocab else 0
                key = seeded_draw.seed_keys([seed if seed is not None else 0])[0]
                row_floats = [params.temperature, 1 - params.top_p, params.min_p]
                row_ints = [*top_k_columns([k])[0], int(params.top_p < 1.0), key, index, 1]
            penalties = [params.repetition_penalty, params.presence_penalty, params.frequency_penalty]
            # (no slot: no penalty, and the scratch row, which it leaves as it is)
            floats.append([*row_floats, *(penalties if slot is not None else [1.0, 0.0, 0.0])])
            processed = not params.do_sample and needs_processing(params)  # (greedy: the processed argmax)
            ints.append([*row_ints, slot if slot is not None else scratch, int(processed)])
            if banned:
                banning.setdefault(tuple(banned), []).append(n)
        floats += [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]] * (size - len(rows))  # (padding: greedy, no penalty)
        ints += [[0, 1, 0, 0, 0, 0, scratch, 0]] * (size - len(rows))
        self.book = book
        self._floats[:, :size] = np.array(floats, dtype=np.float32).T
        self._ints[:, :size] = np.array(ints, dtype=np.int64).T
        self._bans[:size], self._banned[:size] = 0, 0.0  # (no ids: id 0, plus 0)
        for ids, at in banning.items():  # (the first id again to the width: -inf twice is -inf)
            self._bans[at], self._banned[at] = [*ids, *[ids[0]] * (GRAPH_BANNED - len(ids))], NEG_INF
        for host, device in zip(self._host, self._device):  # whole (contiguous: copied without a wait), a few KB
            device.copy_(host, non_blocking=host.is_pinned())

    def moved(self, kind: str, book: PenaltyBook) -> bool:
        """Whether a graph of `kind` penalizes from rows of `book` that were allocated anew since the graphs
        of its kind were captured (which must be captured again)."""
        if not stages(kind)[1] or book.version == self._version:
            return False
        self._version = book.version
        return True

    def pick(self, logits: torch.Tensor, filtered: bool = True, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's token, its logprob and whether it could not be drawn, ``[rows, 3]`` float64, from the
        buffers' first ``len(logits)`` rows: tensor ops and one kernel, nothing read on the host. Without
        `filtered` (no row sets top_k, top_p or min_p: `kind`) their stages are left out; with the step's
        `inputs` (its rows' token ids, a `PENALIZED` kind's) they are marked in the book and the rows penalized."""
        rows = len(logits)
        floats, ints = (t[:, :rows] for t in self._device[:2])
        sampled = ints[5].bool()
        # as the eager sampler: the rows processed (penalized, made finite, the ids of `min_new_tokens` banned:
        # runner/sampling.py), then the stages
        processed = processed_finite(logits if inputs is None else self._penalized(logits, inputs, floats, ints[6]))
        processed.scatter_add_(1, self._device[2][:rows], self._device[3][:rows])  # (-inf + -inf: -inf; x + 0: x)
        best = processed.argmax(-1)  # (a greedy row's that needs processing, as the eager sampler's)
        warped = finite(scaled(processed, floats[0]))
        del processed  # (the pick's memory: `pool_plan.GRAPH_LOGIT_BYTES`)
        if filtered:
            warped = top_k_cut(warped, self.width, ints[0][:, None], ints[1][:, None])
            warped = min_p_cut(top_p_cut(warped, floats[1], ints[2].bool()), floats[2])
        drawn, undrawable = seeded_draw.draw_keyed(warped.softmax(-1), ints[3], ints[4])
        del warped
        greedy = torch.where(ints[7].bool(), best, logits.argmax(-1))
        tokens = torch.where(sampled, drawn, greedy)
        chosen = logits.log_softmax(-1).gather(1, tokens[:, None])
        flags = (undrawable & sampled).to(torch.float64)[:, None]
        return torch.cat((tokens.to(torch.float64)[:, None], chosen.to(torch.float64), flags), dim=1)

    @contextlib.contextmanager
    def kept(self, inputs: torch.Tensor) -> Iterator[None]:
        """The book's marks where a penalized pick marks `inputs` (its rows' slots, their input tokens) put back
        as they were after the block: a capture's warm-up computes the step before its replay, which marks them
        again."""
        book = self.book
        if book is None or book.seen is None or book.counts is None:
            yield
            return
        where = (self._device[1][6, : len(inputs)], inputs)
        seen, counts = book.seen[where], book.counts[where]
        yield
        book.seen.index_put_(where, seen)
        book.counts.index_put_(where, counts)

    def _penalized(
        self, logits: torch.Tensor, inputs: torch.Tensor, floats: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Each row's input token marked in its slot of the book's dense rows (the scratch row's, for rows
        without a penalty: those rows alone share a slot), then the rows penalized from their slots."""
        book = self.book
        assert book is not None and book.seen is not None and book.counts is not None
        book.seen.index_put_((slots, inputs), self._true)
        book.counts.index_put_((slots, inputs), book.counts[slots, inputs] + 1)
        seen = book.seen.index_select(0, slots)
        seen &= (floats[3] != 1.0)[:, None]
        logits = dense_penalized(logits, (seen, floats[3][:, None]))
        del seen  # (the pick's memory: one stage's rows at a time)
        counts = book.counts.index_select(0, slots)
        return dense_penalized(logits, counted=(counts, floats[4][:, None], floats[5][:, None]))


def with_top_n(pick: torch.Tensor, logits: torch.Tensor, top_n: int) -> torch.Tensor:
    """A graph's `pick` (``[rows, 2]`` greedy, ``[rows, 3]`` sampled) and each row's `top_n` likeliest tokens of
    its raw `logits`, as `sampling.sample_rows` takes them: ``[rows, 3 + 2 * top_n]`` float64, the token, its
    logprob, whether it could not be drawn (0 for a greedy pick), the ids, then their logprobs. Tensor ops
    on the device, nothing read on the host."""
    values, ids = torch.topk(logits.log_softmax(-1), min(top_n, logits.shape[-1]))  # (as sample_rows caps it)
    flags = pick[:, 2:3] if pick.shape[1] > 2 else torch.zeros_like(pick[:, :1])
    return torch.cat((pick[:, :2], flags, ids.to(torch.float64), values.to(torch.float64)), dim=1)
