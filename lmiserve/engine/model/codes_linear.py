"""The shape every quantized linear layer shares (`quantize.Int8Linear`, `Int4Linear`, `Q8Linear`,
`quant_formats.Fp8Linear`, `int4_triton.Int4TritonLinear`, `int8_weights.Int8WeightLinear`): each gives the
product of 2-D rows of inputs (`product`); `CodesLinear.forward` flattens the leading dimensions, adds the bias
(rounds a widening kernel's fp32 to the rows' dtype: `WIDENS`) and restores them."""

from __future__ import annotations

import torch


class CodesLinear(torch.nn.Module):
    """A linear layer over stored codes. Subclasses set `in_features`, `out_features` and `bias` (a plain
    attribute or None) and define `product`."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    # whether `product` gives fp32 whatever the rows' dtype (the CPU's kernels): the output, bias added, is then
    # rounded to the rows' dtype once (a model computing in bf16)
    WIDENS = False

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` for 2-D `rows` ``[n, in_features]`` (no bias)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        if self.WIDENS and y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)
