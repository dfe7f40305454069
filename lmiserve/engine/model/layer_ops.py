"""The fast forward's per-token ops as transformers' modules compute them, op for op (engine/model/fast_llama.py
runs them): RMS norms (and Starcoder2's LayerNorms; OLMo 2's of the whole q and k projections), RoPE's rotation by
halves or by pairs, and a fused group's product (q/k/v, gate/up) through the CPU product shapes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lmiserve.engine.model.cpu_gemm import CpuGemm
from lmiserve.engine.model.layout_variants import NormWeight
from lmiserve.engine.model.llama_layout import Part
from lmiserve.engine.model.sharding import TensorParallelShard


def rms_norm(x: torch.Tensor, norm: NormWeight, mean_square: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' RMS norm: in float32, the weight applied after the cast back (Llama's), or before it where
    the weight is float32 (Gemma's ``1 + w``, `layout_variants.norm_of`; alike for a float32 model); or a
    LayerNorm, whose bias is the record's third element (Starcoder2's). `mean_square`: ``[rows, 1]`` float32, the
    mean of the squares over a width wider than `x`'s (a tensor-parallel rank's part of OLMo 2's projections)."""
    weight, eps = norm[0], norm[1]
    if len(norm) == 3:
        return F.layer_norm(x, (x.shape[-1],), weight, norm[2], eps)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt((h.pow(2).mean(-1, keepdim=True) if mean_square is None else mean_square) + eps)
    return (h * weight).to(dtype) if weight.dtype == torch.float32 else weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with the sign folded into the table
    (``(-a) * b == a * (-b)`` exactly, so the values are bit-identical, one op fewer), in the table's dtype and
    cast back to x's (OLMo 2's module gives float32 tables: its rotation runs in float32); `pairs`: GLM's rotation
    of neighbours (each pair's partner swapped in, `rope_tables`)."""
    rotary = cos.shape[-1]  # (a head's first part, Phi-4-mini's: the rest passes unrotated)
    if rotary != x.shape[-1]:
        return torch.cat([rotate(x[..., :rotary], cos, signed_sin, pairs), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    if pairs:  # (GLM's: each neighbour's partner swapped in)
        return (x * cos + x.reshape(*x.shape[:-1], half, 2).flip(-1).flatten(-2) * signed_sin).to(x.dtype)
    return (x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin).to(x.dtype)


def fused_product(gemm: CpuGemm, x: torch.Tensor, parts: Sequence[Part]) -> torch.Tensor:
    """A fused group's product (q/k/v, gate/up): one product, or (a group of an int4 model mixing int4
    and q8 linears) its parts' products concatenated along the features."""
    if len(parts) == 1:
        weight, bias, scales, _ = parts[0]
        return gemm.linear(x, weight, bias, scales)
    return torch.cat([gemm.linear(x, p.weight, p.bias, p.scales)[:, : p.outputs] for p in parts], dim=-1)


def projection_norms(
    qkv: torch.Tensor, norms: tuple[NormWeight, NormWeight], q_size: int, kv_size: int, tp: TensorParallelShard | None
) -> torch.Tensor:
    """OLMo 2's RMS norms of the whole q and of the whole k projection of fused q/k/v rows; a tensor-parallel
    rank's (`tp`) over its heads' part, the mean of the squares of the whole projections all-reduced (one ``[rows,
    2]`` sum: each rank's part is ``1 / world`` of the width, a replicated KV head's counted once a rank that holds
    it)."""
    (q_norm, k_norm), v_at = norms, q_size + kv_size
    q, k = qkv[:, :q_size], qkv[:, q_size:v_at]
    means: list[torch.Tensor | None] = [None, None]
    if tp is not None:
        sums = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], -1)
        sums = tp.all_reduce(sums)
        means = [sums[:, :1] / (q_size * tp.world), sums[:, 1:] / (kv_size * tp.world)]
    return torch.cat([rms_norm(q, q_norm, means[0]), rms_norm(k, k_norm, means[1]), qkv[:, v_at:]], -1)
