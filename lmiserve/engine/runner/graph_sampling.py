"""A decode graph's sampled rows: the step's sampling inside the CUDA graph too (issue #39: the whole decode
step captured, sampling included), so that a step of sampled rows replays one graph, sends its tokens in
the step's one transfer and chains into the next step on the device, as a greedy step does.

A row samples in the graph (`in_graph`) when it is greedy without processing, or sampled with temperature,
top_k (up to `GRAPH_TOP_K`), top_p and min_p alone, either with a top-N of up to `GRAPH_TOP_N` tokens: no
penalty, logit bias, bad words, `min_new_tokens` or typical_p, which stay with the eager sampler
(runner/sampling.py) from the graph's logits: those rows alone, the step's others taking the graph's pick
(runner/persistent_batch.py, `_graph_served`), where a grammar's rows go too. Its parameters are device
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

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner import seeded_draw
from lmiserve.engine.runner.penalties import penalized
from lmiserve.engine.runner.sampling import needs_processing, processed_finite
from lmiserve.engine.runner.warpers import finite, min_p_cut, scaled, top_k_columns, top_k_cut, top_p_cut

__all__ = [
    "FILTERED",
    "GRAPH_TOP_K",
    "GRAPH_TOP_N",
    "SAMPLED",
    "USE_IN_GRAPHS",
    "GraphSampler",
    "in_graph",
    "kind",
    "with_top_n",
]

GRAPH_TOP_K = 1024  # the largest top_k a row sampled in a graph may set (the graph's `topk` is this wide)
GRAPH_TOP_N = 20  # the most top-N tokens a row takes from a graph's step (OpenAI's top_logprobs at most)
USE_IN_GRAPHS = True  # False: a decode graph's sampled rows are sampled after it, from its logits
SAMPLED, FILTERED = "sampled", "sampled-filtered"  # a sampled graph's kinds: without top_k, top_p, min_p; with


def in_graph(params: SamplingParams) -> bool:
    """Whether a row with `params` samples inside a decode graph (the module's doc)."""
    if params.top_n_tokens > GRAPH_TOP_N:
        return False
    if not needs_processing(params):
        return True  # plain greedy
    return (
        params.do_sample
        and not penalized(params)
        and params.min_new_tokens == 0
        and not params.logit_bias
        and not params.bad_words_ids
        and params.typical_p >= 1.0
        and params.top_k <= GRAPH_TOP_K
    )


def kind(params: Iterable[SamplingParams]) -> str:
    """The kind of sampled graph a step of rows with `params` (all `in_graph`) replays: `FILTERED` where a
    sampled row sets top_k, top_p or min_p, else `SAMPLED`."""
    filtered = any(p.do_sample and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
    return FILTERED if filtered else SAMPLED


class GraphSampler:
    """The sampling parameters of a decode graph's rows, for up to `largest` rows: host buffers `fill` writes
    and copies over, and the device buffers `pick` reads (fixed addresses, which a captured graph keeps)."""

    def __init__(self, largest: int, vocab: int, device: torch.device, pin: bool) -> None:
        self.vocab, self.width = vocab, min(GRAPH_TOP_K, vocab)
        # floats: temperature, 1 - top_p, min_p; ints: k - 1, top_k off, top_p on, seed key, token index, sampled
        self._host = (
            torch.ones((3, largest), dtype=torch.float32, pin_memory=pin),
            torch.zeros((6, largest), dtype=torch.int64, pin_memory=pin),
        )
        self._device = tuple(torch.zeros_like(t, device=device) for t in self._host)
        self._floats, self._ints = (t.numpy() for t in self._host)  # written with numpy: no torch op a row

    def fill(self, rows: Sequence[tuple[SamplingParams, int | None, int]], size: int) -> None:
        """The rows' ``(params, seed, index)`` (`index`: the tokens the row's sequence has, those of a step
        still in flight included), padded to `size` greedy rows, copied to the device without a wait."""
        floats, ints = [[1.0, 0.0, 0.0]] * size, [[0, 1, 0, 0, 0, 0]] * size  # greedy: every stage off
        for n, (params, seed, index) in enumerate(rows):
            if params.do_sample:
                k = params.top_k if 0 < params.top_k < self.vocab else 0
                key = seeded_draw.seed_keys([seed if seed is not None else 0])[0]
                floats[n] = [params.temperature, 1 - params.top_p, params.min_p]
                ints[n] = [*top_k_columns([k])[0], int(params.top_p < 1.0), key, index, 1]
        self._floats[:, :size] = np.array(floats, dtype=np.float32).T
        self._ints[:, :size] = np.array(ints, dtype=np.int64).T
        for host, device in zip(self._host, self._device):  # whole (contiguous: copied without a wait), a few KB
            device.copy_(host, non_blocking=host.is_pinned())

    def pick(self, logits: torch.Tensor, filtered: bool = True) -> torch.Tensor:
        """Each row's token, its logprob and whether it could not be drawn, ``[rows, 3]`` float64, from the
        buffers' first ``len(logits)`` rows: tensor ops and one kernel, nothing read on the host. Without
        `filtered` (no row sets top_k, top_p or min_p: `kind`) their stages are left out."""
        rows = len(logits)
        floats, ints = (t[:, :rows] for t in self._device)
        sampled = ints[5].bool()
        # as the eager sampler: the rows made finite as processed rows are (runner/sampling.py), then the stages
        warped = finite(scaled(processed_finite(logits), floats[0]))
        if filtered:
            warped = top_k_cut(warped, self.width, ints[0][:, None], ints[1][:, None])
            warped = min_p_cut(top_p_cut(warped, floats[1], ints[2].bool()), floats[2])
        drawn, undrawable = seeded_draw.draw_keyed(warped.softmax(-1), ints[3], ints[4])
        tokens = torch.where(sampled, drawn, logits.argmax(-1))
        chosen = logits.log_softmax(-1).gather(1, tokens[:, None])
        flags = (undrawable & sampled).to(torch.float64)[:, None]
        return torch.cat((tokens.to(torch.float64)[:, None], chosen.to(torch.float64), flags), dim=1)


def with_top_n(pick: torch.Tensor, logits: torch.Tensor, top_n: int) -> torch.Tensor:
    """A graph's `pick` (``[rows, 2]`` greedy, ``[rows, 3]`` sampled) and each row's `top_n` likeliest tokens of
    its raw `logits`, as `sampling.sample_rows` takes them: ``[rows, 3 + 2 * top_n]`` float64, the token, its
    logprob, whether it could not be drawn (0 for a greedy pick), the ids, then their logprobs. Tensor ops
    on the device, nothing read on the host."""
    values, ids = torch.topk(logits.log_softmax(-1), min(top_n, logits.shape[-1]))  # (as sample_rows caps it)
    flags = pick[:, 2:3] if pick.shape[1] > 2 else torch.zeros_like(pick[:, :1])
    return torch.cat((pick[:, :2], flags, ids.to(torch.float64), values.to(torch.float64)), dim=1)
