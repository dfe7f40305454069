"""The shape every quantized linear layer shares (`quantize.Int8Linear`, `Int4Linear`, `Q8Linear`,
`quant_formats.Fp8Linear`, `int4_triton.Int4TritonLinear`, `int8_weights.Int8WeightLinear`): each gives the
product of 2-D rows of inputs (`product`); `CodesLinear.forward` flattens the leading dimensions, adds the bias
(rounds a CPU kernel's fp32 to the rows' dtype: `in_rows_dtype`) and restores them."""

from __future__ import annotations

import torch


class CodesLinear(torch.nn.Module):
    """A linear layer over stored codes. Subclasses set `in_features`, `out_features` and `bias` (a plain
    attribute or None) and define `product`."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` for 2-D `rows` ``[n, in_features]`` (no bias)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return in_rows_dtype(y, x).view(*x.shape[:-1], self.out_features)


def in_rows_dtype(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The product `y` (its bias added) of rows `x`, in the rows' dtype where a CPU's kernel gave fp32 for rows of
    another (`quantize.Int4Linear`'s and `Q8Linear`'s multiply in fp32: a bf16 model's output rounded once); else
    `y` as it is. What the modules' forward and the fast forward's product (`CpuGemm.linear`) both apply."""
    widened = y.device.type == "cpu" and y.dtype == torch.float32 and x.dtype != torch.float32
    return y.to(x.dtype) if widened else y
