"""``x @ W.T`` for a few rows of ``x`` on CPU as one compiled kernel (numba): W read once.

Why: a step of a few tokens (a request's last token and its drafted tokens, verified in one chunk; a
handful of decode rows) is bound by reading the weights, so 5 rows should cost about what 1 row does.
CPU BLAS does not get there: for 2-8 rows MKL/oneDNN's fp32 GEMM ran 2-3x slower than for one row on
the AMD EPYC (a layer-sized product, cache-hot, 1/3/5/8 rows: 144/432/359/378 us), and its transposed
product only runs fast for a multiple of 8 rows (so `cpu_gemm` pads rows). This kernel splits W's
output rows among the threads; each task takes one row of W (one contiguous stream from memory) and
multiplies it by the rows of ``x`` two at a time, vectorised over the inner dimension, so every
weight comes from memory once and is reused from L1 for the other rows. Measured on the AMD EPYC (2
threads, SmolLM2-135M's 120 layer products, weights from memory, ms for 1/2/3/5/8/9 rows): this
kernel 13.0/14.3/14.5/18.3/26.4/29.4, `cpu_gemm`'s BLAS choices 13.7/15.8/23.9/29.9/39.6/50.5. Tiles
of 2 or 4 rows of W (more sums a load) and software prefetch of the next rows were slower: the reads
of one row at a time stream best.

Float32 CPU tensors only (what numba compiles for); `available(...)` says when it applies. `cpu_gemm.
CpuGemm` routes products of up to its `few_rows` rows here (measured per CPU by `autotune`). Numerics:
fp32 accumulation in another order than BLAS (vectorised over the inner dimension), so results
differ from ``F.linear`` in the last bits, as two BLAS kernels do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA, lazily_compiled, numba

_F32 = npt.NDArray[np.float32]


def _kernel(x: _F32, w: _F32, out: _F32) -> None:  # pragma: no cover - compiled
    """``out[m, n] = sum_k x[m, k] * w[n, k]`` (``x`` ``[M, K]``, ``w`` ``[N, K]``, ``out`` ``[M, N]``)."""
    rows, inner = x.shape
    zero = np.float32(0.0)
    for n in numba.prange(w.shape[0]):
        m = 0
        while m + 2 <= rows:
            a = zero
            b = zero
            for k in range(inner):
                weight = w[n, k]
                a += weight * x[m, k]
                b += weight * x[m + 1, k]
            out[m, n] = a
            out[m + 1, n] = b
            m += 2
        if m < rows:
            a = zero
            for k in range(inner):
                a += w[n, k] * x[m, k]
            out[m, n] = a


_compiled_kernel = lazily_compiled(_kernel)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `linear` serves weights of this dtype on this device."""
    return HAVE_NUMBA and device.type == "cpu" and dtype == torch.float32


def warm_up() -> None:
    """Compile the kernel (a few seconds; later processes load it from numba's cache)."""
    linear(torch.zeros(3, 8), torch.zeros(5, 8))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[M, K]``, ``weight`` ``[N, K]``, fp32 CPU) as a contiguous ``[M, N]``."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _compiled_kernel()(x.contiguous().numpy(), weight.contiguous().numpy(), out.numpy())
    return out
