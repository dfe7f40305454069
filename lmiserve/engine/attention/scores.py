"""Attention scores beyond a plain causal softmax, in torch ops (the Triton kernel applies the same in
attention/triton_kernel.py; the compiled CPU kernel neither, so such a model's attention takes torch ops there):

- a soft cap, ``c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``);
- attention sinks: one more logit for each head in every row's softmax, which takes probability and gives no
  value (gpt-oss's ``sinks``), so a row's weights over its positions sum to less than one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prefill chunk's attention (``[1, heads, tokens, head_dim]`` against ``[1, heads, keys, head_dim]``, a
    boolean `mask`): SDPA, or with the scores soft-capped (`softcap`: ``c * tanh(s / c)``, Gemma 2's) before the
    mask, or a sink logit a head in the softmax (`sinks` ``[heads]``, gpt-oss's), torch ops with an fp32 softmax."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    scores = soft_cap(torch.matmul(query, key.transpose(-1, -2)).float() * scale, softcap)
    scores = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    heads = None if sinks is None else sinks.view(1, -1, 1, 1)
    return torch.matmul(sink_softmax(scores, heads).to(value.dtype), value)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (`x` itself without a cap): Gemma 2's attention scores, Gemma's logits."""
    return x if cap is None else torch.tanh(x / cap) * cap


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax of fp32 `scores` over their last dimension; with `sinks` (broadcast to ``scores[..., :1]``) one
    more logit a row that takes probability and gives no value (gpt-oss's attention sinks: the row's weights sum
    to less than one)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
