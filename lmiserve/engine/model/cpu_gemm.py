"""Linear products (``x @ W.T``) in the shapes CPU BLAS runs fastest.

Three choices, measured per CPU at start-up (`engine/model/autotune.py`) because what wins on one CPU
loses on another (figures in benchmarks/README.md):
- orientation: from `transpose_from` rows (from `vocab_transpose_from` for a vocabulary-sized
  matrix) ``x @ W.T`` as ``(W @ x.T).T``. On the AMD EPYC MKL ran layer matrices 1.1-1.4x and the
  vocabulary matrix 1.6-3x faster that way, but only for a multiple of 8 rows (30 or 31 rows took
  1.7-2x as long as 32), so a transposed product's rows are padded (`row_padding`: from 5 rows; from
  2 for the vocabulary product) to the next multiple of `ROW_MULTIPLE`;
- row blocks: fewer rows as a batched product over `splits` row blocks of W (a matrix-vector
  product ran on one core of the EPYC, the blocks on all of them: 2x at 1 row);
- or neither: plain ``F.linear`` (oneDNN/MKL's own choice);
- few rows (`few_rows`, fp32): products of 2 to `few_rows` rows through a compiled kernel that reads W
  once (`skinny_gemm`), unpadded: a chunk of a few tokens (a request's last token and its drafts) then
  costs little more than one row, where the BLAS choices above cost 1.4-3x (on the AMD EPYC).

`CpuGemm.for_model` gives the static defaults (the EPYC's choices for fp32 CPU products, plain
elsewhere); `autotune` replaces them with what measured fastest on this CPU. Weight-only int8
matrices (`scales` given) always go through their kernel (`quantize.quantized_linear`: int8 or int4). The values are
those of ``F.linear`` up to the summation order of the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lmiserve.engine.model import skinny_gemm
from lmiserve.engine.model.codes_linear import in_rows_dtype
from lmiserve.engine.model.input_order import InputOrder
from lmiserve.engine.model.int4_triton import Int4Scales
from lmiserve.engine.model.int8_weights import Int8Scales
from lmiserve.engine.model.quantize import quantized_linear

log = logging.getLogger(__name__)

TRANSPOSED_GEMM_ROWS = 8  # rows from which a product runs transposed (static default)
ROW_MULTIPLE = 8  # a transposed product's rows are padded to a multiple of this
PAD_ROWS_FROM = 5  # layer products pad from this many rows
VOCAB_PAD_ROWS_FROM = 2  # a vocabulary-sized product runs transposed (and pads) from 2 rows
BIG_OUT = 8192  # output features from which a product counts as vocabulary-sized
NEVER = 1 << 30  # a row count no step reaches: "never transposed"
FEW_ROWS = 9  # products of 2..this many rows run through `skinny_gemm` (static default; 1 token + 8 drafts)


@dataclass(frozen=True)
class CpuGemm:
    """The product shapes of one model. `splits` > 1: products of fewer rows than `transpose_from`
    (and than `TRANSPOSED_GEMM_ROWS`) run over that many row blocks of W; `transpose_from` /
    `vocab_transpose_from`: rows from which a product runs transposed (`NEVER`: never); `pad`: a
    transposed product's rows are padded to a multiple of `ROW_MULTIPLE`; `few_rows`: products of 2 to
    this many rows (fp32 on CPU) run through `skinny_gemm` and are never padded (0: never). The default
    instance is plain ``F.linear`` everywhere."""

    splits: int = 1
    transpose_from: int = NEVER
    vocab_transpose_from: int = NEVER
    pad: bool = False
    few_rows: int = 0

    @classmethod
    def plain(cls) -> CpuGemm:
        return cls()

    @classmethod
    def tuned_default(cls, threads: int | None = None) -> CpuGemm:
        """The static CPU choice (measured on the AMD EPYC, fp32): row blocks for 1 row, the few-row
        kernel for 2-9 rows, transposed from 10 rows (vocabulary: likewise), rows padded."""
        splits = max(2, threads if threads is not None else torch.get_num_threads())
        few = FEW_ROWS if skinny_gemm.available(torch.float32, torch.device("cpu")) else 0
        return cls(splits, TRANSPOSED_GEMM_ROWS, VOCAB_PAD_ROWS_FROM, True, few)

    @classmethod
    def for_model(cls, device: torch.device, dtype: torch.dtype) -> CpuGemm:
        """Static default: tuned on CPU for fp32 (the only case measured before autotuning), plain
        elsewhere."""
        return cls.tuned_default() if device.type == "cpu" and dtype == torch.float32 else cls.plain()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CpuGemm:
        return cls(
            int(values["splits"]),
            int(values["transpose_from"]),
            int(values["vocab_transpose_from"]),
            bool(values["pad"]),
            int(values.get("few_rows", 0)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> CpuGemm:
        values = {**self.to_dict(), **changes}
        return CpuGemm.from_dict(values)

    def warmed(self, dtype: torch.dtype, device: torch.device) -> CpuGemm:
        """These shapes with the few-row kernel compiled now (at load, or on a kernel change: not on a request);
        if it cannot be compiled, with products of few rows through BLAS instead."""
        if self.few_rows > 1 and skinny_gemm.available(dtype, device):
            try:
                skinny_gemm.warm_up()
            except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the model
                log.exception("compiled few-row products unavailable; using BLAS")
                return self.with_(few_rows=0)
        return self

    def describe(self) -> str:
        parts = [f"{self.splits} row blocks for fewer rows" if self.splits > 1 else ""]
        if self.few_rows > 1:
            parts.append(f"few-row kernel for 2-{self.few_rows} rows")
        if self.transpose_from < NEVER:
            fewer = self.few_rows + 1 if self.few_rows > 1 else 0  # the few-row kernel takes precedence
            layers, vocab = max(self.transpose_from, fewer), max(self.vocab_transpose_from, fewer)
            parts.append(f"transposed from {layers} rows (vocabulary from {vocab})")
        if self.pad:
            parts.append(f"rows padded to x{ROW_MULTIPLE}")
        text = ", ".join(p for p in parts if p)
        return text or "plain F.linear"

    @property
    def tuned(self) -> bool:
        return self.splits > 1 or self.transpose_from < NEVER or self.vocab_transpose_from < NEVER or self.few_rows > 1

    def row_padding(self, rows: int, pad_from: int = PAD_ROWS_FROM) -> int:
        """Rows to add (when padding, from `pad_from` rows, past `few_rows`) up to a multiple of `ROW_MULTIPLE`."""
        return (-rows) % ROW_MULTIPLE if self.pad and rows >= pad_from and rows > self.few_rows else 0

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scales: torch.Tensor | Int4Scales | Int8Scales | InputOrder | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``weight`` ``[out, in]`` (int8 with its row `scales`, or float; AWQ/GPTQ
        codes with their `Int4Scales`; 8-bit codes on CUDA with their `Int8Scales`).
        A transposed product returns a transposed view (``[rows, out]`` with strides ``(1, rows)``):
        the next `linear` takes it as is (its transpose is contiguous) and element-wise ops accept it."""
        if scales is not None:
            y = quantized_linear(x, weight, scales)
            return in_rows_dtype(y if bias is None else y + bias, x)
        rows, out = x.shape[0], weight.shape[0]
        few = 2 <= rows <= self.few_rows and x.dtype == weight.dtype
        if few and skinny_gemm.available(weight.dtype, weight.device):
            y = skinny_gemm.linear(x, weight)
            return y if bias is None else y + bias
        if rows >= (self.vocab_transpose_from if out > BIG_OUT else self.transpose_from):
            y = torch.mm(weight, x.t()).t()
            return y if bias is None else y + bias
        splits = self.splits
        if splits > 1 and rows < min(self.transpose_from, TRANSPOSED_GEMM_ROWS) and out % splits == 0:
            parts = weight.view(splits, out // splits, weight.shape[1])
            y = torch.bmm(parts, x.t().expand(splits, -1, -1)).view(out, rows).t()
            return y if bias is None else y + bias
        return F.linear(x, weight, bias)
