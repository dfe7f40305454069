"""The compiled CPU attention's shared parts (numba): the in-place row softmax the kernels of
paged_attention.py inline, and where they apply.

Float32 CPU tensors only (what numba compiles for); `available(...)` says when they apply, and the torch
path serves everything else (GPU, bf16/fp16). Numerics: fp32 accumulation in another order than BLAS, so
results differ from the torch path in the last bits, as two BLAS kernels do.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA, numba

_F32 = npt.NDArray[np.float32]


def softmax_rows(scores: _F32) -> None:  # pragma: no cover - compiled
    """Each row of `scores` (``[groups, span]``) into its softmax, in place (max-subtracted, fp32); the
    kernels of paged_attention.py call it compiled and inlined."""
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


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled kernels serve a model of this dtype on this device."""
    return HAVE_NUMBA and device.type == "cpu" and dtype == torch.float32
