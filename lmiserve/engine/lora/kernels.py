"""A step's LoRA products for a few token rows on CPU, as two compiled kernels (numba) a group of linears:
every adapter's weights read once, each token multiplied by its own adapter's only (punica's SGMV
shrink and expand, for the CPU).

Why: a decode step of a few rows is bound by reading weights. Its LoRA products are small (rank x width)
and there is one pair per adapted linear a layer, so as torch products (`lora.LoraBatch`'s stacked
form: one product of every token with every active adapter's A, a mask, one product a linear with the
B matrices) they cost their calls' overheads and read the adapters' weights at a fraction of the
bandwidth the base weights stream at: on the AMD EPYC, SmolLM2-135M with 4 adapters of rank 16 on
every linear, a step of 8 rows took 53.8 ms against 38.8 ms without adapters (benchmarks/README.md,
"LoRA"). Here each group is two calls: `shrink` (``low[m, c] = A[c] . x[m]`` for the columns c of token
m's adapter, split over A's rows among the threads) and `expand` (``out[m, o] += sum_c low[m, c] *
B^T[c, o]`` over the columns of m's adapter, split over blocks of output columns: each B^T row read once
a block, vectorised over the outputs).

Float32 CPU tensors only; `available` says when it applies. Numerics: fp32 sums in another order than
BLAS, so results differ from the torch path in the last bits, as two BLAS kernels do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA, lazily_compiled, numba

__all__ = ["BLOCK", "MAX_ROWS", "available", "blocks", "expand", "shrink", "warm_up"]

_F32 = npt.NDArray[np.float32]
_I64 = npt.NDArray[np.int64]

# token rows up to which the kernels run (beyond: the torch products, whose BLAS wins on compute)
MAX_ROWS = 64
# output columns of one `expand` task (SmolLM2's gate/up, 4 adapters of rank 16, 8 and 32 tokens, the
# AMD EPYC: 128 / 256 / 512 columns took 24 / 19 / 17 us and 89 / 74 / 67 us, cache-hot)
BLOCK = 256


def _shrink(x: _F32, a: _F32, col_owner: _I64, row_owner: _I64, low: _F32) -> None:  # pragma: no cover - compiled
    """``low[m, c] = sum_k a[c, k] * x[m, k]`` where token m's adapter owns column c, else 0."""
    rows, inner = x.shape
    zero = np.float32(0.0)
    for c in numba.prange(a.shape[0]):
        owner = col_owner[c]
        for m in range(rows):
            if row_owner[m] != owner:
                low[m, c] = zero
                continue
            acc = zero
            for k in range(inner):
                acc += a[c, k] * x[m, k]
            low[m, c] = acc


def _expand(
    low: _F32,
    row_owner: _I64,
    bt: _F32,
    seg_start: _I64,
    seg_end: _I64,
    task_part: _I64,
    task_first: _I64,
    task_end: _I64,
    out: _F32,
) -> None:  # pragma: no cover - compiled
    """``out[m, o] += sum_c low[m, c] * bt[c, o]`` over the columns c of token m's adapter in the part of
    output column o (``seg_start[p, a]..seg_end[p, a]``), a task a block of one part's output columns:
    each row of ``bt`` (B transposed: a column's weights over its part's outputs) read once a task and
    reused for the block's tokens, vectorised over the outputs."""
    rows = low.shape[0]
    for t in numba.prange(task_part.shape[0]):
        part = task_part[t]
        first = task_first[t]
        end = task_end[t]
        width = end - first
        acc = np.empty(width, dtype=np.float32)
        for m in range(rows):
            owner = row_owner[m]
            if owner < 0:
                continue
            start, stop = seg_start[part, owner], seg_end[part, owner]
            if start == stop:
                continue
            acc[:] = 0.0
            for c in range(start, stop):
                value = low[m, c]
                weights = bt[c, first:end]
                for j in range(width):
                    acc[j] += value * weights[j]
            target = out[m, first:end]
            for j in range(width):
                target[j] += acc[j]


_compiled_shrink = lazily_compiled(_shrink)
_compiled_expand = lazily_compiled(_expand)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return HAVE_NUMBA and device.type == "cpu" and dtype == torch.float32


def shrink(x: torch.Tensor, a: npt.NDArray[np.float32], col_owner: _I64, row_owner: _I64) -> _F32:
    """Every token's low-rank activations of its own adapter (``[rows, columns]``, 0 elsewhere)."""
    low = np.empty((x.shape[0], a.shape[0]), dtype=np.float32)
    _compiled_shrink()(x.contiguous().numpy(), a, col_owner, row_owner, low)
    return low


def expand(
    low: _F32,
    row_owner: _I64,
    bt: _F32,
    seg_start: _I64,
    seg_end: _I64,
    tasks: tuple[_I64, _I64, _I64],
    out: torch.Tensor,
) -> None:
    """Add every token's delta into `out` (``[rows, width]``, any strides: written in place); `tasks`: each
    task's part, first and end output column (`blocks`)."""
    _compiled_expand()(low, row_owner, bt, seg_start, seg_end, *tasks, out.numpy())


def blocks(parts: list[tuple[int, int]]) -> tuple[_I64, _I64, _I64]:
    """`expand`'s tasks for parts of these output columns (``(first, end)`` each): blocks of at most
    `BLOCK` columns of one part."""
    task_part, task_first, task_end = [], [], []
    for index, (first, end) in enumerate(parts):
        for at in range(first, end, BLOCK):
            task_part.append(index)
            task_first.append(at)
            task_end.append(min(at + BLOCK, end))
    return (
        np.array(task_part, dtype=np.int64),
        np.array(task_first, dtype=np.int64),
        np.array(task_end, dtype=np.int64),
    )


def warm_up() -> None:
    """Compile both kernels (for contiguous and transposed outputs), or load them from numba's cache."""
    x = torch.zeros(2, 4)
    a = np.zeros((3, 4), dtype=np.float32)
    owners = np.zeros(3, dtype=np.int64)
    rows = np.zeros(2, dtype=np.int64)
    low = shrink(x, a, owners, rows)
    bt = np.zeros((3, 5), dtype=np.float32)
    segs = (np.zeros((1, 1), dtype=np.int64), np.full((1, 1), 3, dtype=np.int64))
    for out in (torch.zeros(2, 5), torch.zeros(5, 2).t()):
        expand(low, rows, bt, *segs, blocks([(0, 5)]), out)
