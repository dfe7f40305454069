"""Linear products (``x @ W.T``) in the shapes CPU BLAS runs fastest.

MKL runs the same products much faster in other shapes (2 cores, fp32; the figures are in
benchmarks/README.md):
- from 8 rows on (from 2 for a vocabulary-sized matrix) ``x @ W.T`` as ``(W @ x.T).T``: layer
  matrices 1.1-1.4x, the vocabulary matrix 1.6-3x faster;
- but only for a multiple of 8 rows: 30 or 31 rows take 1.7-2x as long as 32, so a caller pads its
  rows (from 5 on; from 2 for the vocabulary product) up to the next multiple (`row_padding`);
- fewer rows as a batched product over row blocks of W: a matrix-vector product runs on one core,
  the blocks on all of them (2x at 1 row).

Measured for fp32 CPU products only: elsewhere `CpuGemm` is plain ``F.linear`` and pads nothing.
The values are those of ``F.linear`` up to the summation order of the BLAS kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRANSPOSED_GEMM_ROWS = 8  # rows from which a product runs transposed
ROW_MULTIPLE = 8  # a transposed product's rows are padded to a multiple of this
PAD_ROWS_FROM = 5  # layer products pad from this many rows
VOCAB_PAD_ROWS_FROM = 2  # a vocabulary-sized product runs transposed (and pads) from 2 rows
BIG_OUT = 8192  # output features from which a product counts as vocabulary-sized


class CpuGemm:
    """The product shapes of one model. `splits` > 1 turns the CPU tuning on (the number of row blocks
    of W for products of few rows: the CPU threads); 1 means plain ``F.linear``."""

    def __init__(self, splits: int = 1) -> None:
        self.splits = splits

    @classmethod
    def for_model(cls, device: torch.device, dtype: torch.dtype) -> CpuGemm:
        """Tuned on CPU for fp32 (the only case measured), plain elsewhere."""
        tuned = device.type == "cpu" and dtype == torch.float32
        return cls(max(2, torch.get_num_threads()) if tuned else 1)

    @property
    def tuned(self) -> bool:
        return self.splits > 1

    def row_padding(self, rows: int, pad_from: int = PAD_ROWS_FROM) -> int:
        """Rows to add (when tuned, from `pad_from` rows) up to a multiple of `ROW_MULTIPLE`."""
        return (-rows) % ROW_MULTIPLE if self.splits > 1 and rows >= pad_from else 0

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``weight`` ``[out, in]``. A transposed product returns a
        transposed view (``[rows, out]`` with strides ``(1, rows)``): the next `linear` takes it as is
        (its transpose is contiguous) and element-wise ops accept it."""
        splits = self.splits
        if splits > 1:
            rows, out = x.shape[0], weight.shape[0]
            if rows >= TRANSPOSED_GEMM_ROWS or (rows > 1 and out > BIG_OUT):
                y = torch.mm(weight, x.t()).t()
                return y if bias is None else y + bias
            if out % splits == 0:
                parts = weight.view(splits, out // splits, weight.shape[1])
                y = torch.bmm(parts, x.t().expand(splits, -1, -1)).view(out, rows).t()
                return y if bias is None else y + bias
        return F.linear(x, weight, bias)
