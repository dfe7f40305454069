"""Decode attention on CPU as one compiled kernel (numba): each row's new key/value written into its
cache slot, then its query heads attend over exactly its own positions.

Why: in a decode step every row has one query token per head and its own cache length. As torch ops
that is batched matmuls with 3 query rows each over the longest row's span (padding included), plus
masking, softmax and, for a mixed batch, a split into a shared part and the long rows' tails
(`fast_llama._DecodePlan`): ~20 ops a layer that read the cache at about half the memory bandwidth.
This kernel reads each row's keys and values once, for its own length only, in one call a layer
(measured in benchmarks/README.md: 40 ms -> 13 ms a step at batch 32 with the bench's length mix).

Float32 CPU tensors only (what numba compiles for); `available(...)` says when it applies, and the
torch path serves everything else (GPU, bf16/fp16). Numerics: fp32 accumulation in another order
than BLAS, so results differ from the torch path in the last bits, as two BLAS kernels do.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA, lazily_compiled, numba

_F32 = npt.NDArray[np.float32]


def softmax_rows(scores: _F32) -> None:  # pragma: no cover - compiled
    """Each row of `scores` (``[groups, span]``) into its softmax, in place (max-subtracted, fp32); the
    kernels here and in paged_attention.py call it compiled and inlined."""
    groups, span = scores.shape
    for g in range(groups):
        top = scores[g, 0]
        for j in range(1, span):
            if scores[g, j] > top:
                top = scores[g, j]
        total = np.float32(0.0)
        for j in range(span):
            e = np.float32(math.exp(scores[g, j] - top))
            scores[g, j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(span):
            scores[g, j] *= inv


if numba is not None:  # compiled with the first kernel that calls it
    softmax_rows = numba.njit(inline="always", fastmath=True, cache=True, nogil=True)(softmax_rows)


def _kernel(  # pragma: no cover - compiled
    query: _F32,
    keys: _F32,
    values: _F32,
    new_keys: _F32,
    new_values: _F32,
    spans: npt.NDArray[np.int64],
    scale: np.float32,
    out: _F32,
) -> None:
    rows, kv_heads, groups, dim = query.shape
    for task in numba.prange(rows * kv_heads):
        row = task // kv_heads
        head = task % kv_heads
        span = spans[row]
        last = span - 1
        for d in range(dim):
            keys[row, head, last, d] = new_keys[row, head, d]
            values[row, head, last, d] = new_values[row, head, d]
        scores = np.empty((groups, span), dtype=np.float32)
        for j in range(span):
            for g in range(groups):
                acc = np.float32(0.0)
                for d in range(dim):
                    acc += query[row, head, g, d] * keys[row, head, j, d]
                scores[g, j] = acc * scale
        softmax_rows(scores)
        for g in range(groups):
            for d in range(dim):
                out[row, head, g, d] = 0.0
            for j in range(span):
                p = scores[g, j]
                for d in range(dim):
                    out[row, head, g, d] += p * values[row, head, j, d]


_compiled_kernel = lazily_compiled(_kernel)


def warm_up() -> None:
    """Compile the kernel (about 2 s; later processes load it from numba's cache in well under 1 s)."""
    query = torch.zeros(1, 1, 1, 8)
    cache = torch.zeros(1, 1, 2, 8)
    decode_attention(query, cache, cache.clone(), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), np.array([1]), 1.0)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `decode_attention` serves a model of this dtype on this device."""
    return HAVE_NUMBA and device.type == "cpu" and dtype == torch.float32


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    spans: npt.NDArray[np.int64],
    scale: float,
) -> torch.Tensor:
    """Rows ``0..R-1`` (slot = row): write ``new_keys``/``new_values`` (``[R, kv_heads, head_dim]``) at
    position ``spans[r] - 1`` of the layer cache ``keys``/``values`` (``[slots, kv_heads, capacity,
    head_dim]``, contiguous), then attend ``query`` (``[R, kv_heads, groups, head_dim]``) over
    positions ``0..spans[r]-1``. Returns ``[R, kv_heads, groups, head_dim]``."""
    out = torch.empty_like(query)
    _compiled_kernel()(
        query.contiguous().numpy(),
        keys.numpy(),
        values.numpy(),
        new_keys.contiguous().numpy(),
        new_values.contiguous().numpy(),
        spans,
        np.float32(scale),
        out.numpy(),
    )
    return out
