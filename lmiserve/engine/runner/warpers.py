"""The warpers of a sampled row, in the order transformers applies them: temperature, top_k, top_p, min_p,
typical_p, each as its transformers `LogitsWarper` computes it (tests/unit/test_sampling.py holds them to
transformers'). `warp_rows` takes a step's sampled rows together, each by its own parameters, a stage once
for all of them; a row comes out as it would alone.
"""

from __future__ import annotations

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.host_copy import to_device

NEG_INF = float("-inf")


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """temperature, top_k, top_p, min_p, typical_p (in the order transformers applies them) of one row."""
    return warp_rows(logits[None], [params])[0]


def warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`warp` of each row of `logits` ([rows, vocab]) by its own parameters, each stage once for all the
    rows (a few launches a step, not a chain a row): the rows that do not set a stage pass it unchanged, and
    each row comes out as it would alone. On a CPU `top_p` goes row by row."""
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]
    if any(p.temperature != 1.0 for p in params):  # a row at 1.0 divided by 1.0: unchanged
        logits = scaled(logits, to_device([p.temperature for p in params], device, dtype))
    logits = finite(logits)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        logits = top_k_cut(logits, max(top_k), *to_device(top_k_columns(top_k), device)[:, None, :].unbind(-1))
    if any(p.top_p < 1.0 for p in params):
        if device.type == "cpu" and vocab > 8192:  # (`logits` is the stages' own tensor)
            for row, p in zip(logits, params):
                if p.top_p < 1.0:
                    row.copy_(_top_p(row, p.top_p))
        else:
            logits = _top_p_rows(logits, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):  # a row at 0.0 removes nothing
        logits = min_p_cut(logits, to_device([p.min_p for p in params], device, dtype))
    typical = [i for i, p in enumerate(params) if p.typical_p < 1.0]
    if len(typical) == len(params):
        logits = _typical_p_rows(logits, [p.typical_p for p in params])
    elif typical:  # only the rows that set it: the others keep their logits and skip its sort
        at = to_device(typical, device)
        warped = _typical_p_rows(logits.index_select(0, at), [params[i].typical_p for i in typical])
        logits = logits.index_copy(0, at, warped)
    return logits


# the stages on device tensors of the rows' parameters (a [rows] tensor each): `warp_rows` makes them from the
# rows' parameters, a decode graph keeps them in its buffers (runner/graph_sampling.py); the same ops either way


def scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature[:, None]


def finite(logits: torch.Tensor) -> torch.Tensor:
    """Extreme temperatures or penalties overflow to inf: keep the ranking, stay finite."""
    return torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max)


def top_k_columns(top_k: list[int]) -> list[list[int]]:
    """Each row's ``[k - 1, off]`` for `top_k_cut` (`top_k` 0: off)."""
    return [[max(k - 1, 0), int(k == 0)] for k in top_k]


def top_k_cut(logits: torch.Tensor, largest: int, kth_at: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """transformers' `TopKLogitsWarper` of each row: the tokens below its k-th likeliest removed (`kth_at`:
    k - 1, ``[rows, 1]``; `off` ``[rows, 1]`` nonzero: the row unchanged); `largest`: at least every row's k."""
    kth = torch.topk(logits, largest).values.gather(1, kth_at)  # the likeliest first
    kth = kth.masked_fill(off.bool(), NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_cut(logits: torch.Tensor, below: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """`_top_p`'s sort of each row by its own ``below`` (``1 - top_p``, ``[rows]``), the rows where `on`."""
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= below[:, None]
    remove[:, -1] = False
    remove &= on[:, None]
    return logits.masked_fill(remove.scatter(1, order, remove), NEG_INF)


def min_p_cut(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' `MinPLogitsWarper` of each row (`min_p` ``[rows]``; 0.0 removes nothing)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], NEG_INF)


def _typical_p_rows(logits: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """transformers' `TypicalLogitsWarper` of each row of `logits` by its own `typical_p`, all at once (the
    cuts found on the device): the tokens whose surprise is closest to the row's entropy are kept until
    their probabilities reach `typical_p` (the one that reaches it included)."""
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).nansum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shift, order = torch.sort(shifted)
    cumulative = logits.softmax(-1).gather(-1, order).cumsum(-1)
    mass = to_device(typical_p, logits.device, logits.dtype)[:, None]
    last = (cumulative < mass).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove = sorted_shift > sorted_shift.gather(-1, last)
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def _top_p_rows(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """`_top_p`'s sort of each row of `logits` by its own `top_p` (rows at 1.0 unchanged), all at once."""
    below = to_device([1 - p for p in top_p], logits.device, logits.dtype)
    return top_p_cut(logits, below, to_device([p < 1.0 for p in top_p], logits.device, torch.bool))


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' `TopPLogitsWarper`: the likeliest tokens whose probabilities, the less likely ones first,
    add up to more than ``1 - top_p`` are kept (the likeliest always). On a GPU by its ascending sort of the
    whole vocabulary; on a CPU, where that sort costs ~5 ms a token at 49,152 tokens, from the likeliest
    tokens only (`topk` of 256, then of 8,192, until the kept ones end inside them; else the sort): a token
    is kept while the tokens likelier than it hold less than `top_p` (in float64). The 8,192 are skipped
    where the 256 show that they cannot hold the nucleus (a flat distribution: the sort at once)."""
    if logits.device.type == "cpu" and logits.shape[-1] > 8192:
        probs = logits.to(torch.float64).softmax(-1)
        for k in (256, 8192):
            top, ids = torch.topk(probs, k)  # sorted, the likeliest first
            before = top.cumsum(-1) - top  # what the tokens likelier than each hold
            kept = max(int((before < top_p).sum()), 1)
            if kept < k:
                keep = ids[:kept]
                return torch.full_like(logits, NEG_INF).index_copy_(0, keep, logits[keep])
            held, least = float(before[-1] + top[-1]), float(top[-1])
            if k == 256 and least > 0 and k + (top_p - held) / least > 8192:
                break  # the tokens after these hold at most `least` each: the nucleus is longer than 8,192
    return _top_p_rows(logits[None], [top_p])[0]
