"""Weight-only int8 linear layers (``dtype=int8``): per-output-channel symmetric int8 weights, products
in bf16 through torch's own CPU kernel ``torch.ops.aten._weight_int8pack_mm``.

Why: decoding a few rows reads every weight once a step, so at small batches a step costs about the
bytes it reads. int8 weights are a quarter of fp32's (half of bf16's). Activations, the KV cache, the
embeddings and the output projection stay in bf16 (the vocabulary matrix is tied to the embeddings
in most small models; quantizing it changes the logits the most).

Quantization: for each output row ``scale = max|w| / 127`` and ``q = round(w / scale)`` clamped to
``[-127, 127]`` (symmetric, no zero point); the kernel computes ``x @ (q * scale).T`` with fp32
accumulation and rounds the result to bf16. The kernel needs ``in_features`` a multiple of 16 (it
crashes otherwise, torch 2.13): other linears are left in bf16.

`quantize_linears` swaps the model's `torch.nn.Linear` modules for `Int8Linear` in place, so the
transformers forward (`generate`, the generic runner) and lmiserve's fast forward read the same
quantized weights.
"""

from __future__ import annotations

import torch

INT8_COMPUTE_DTYPE = torch.bfloat16  # what the int8 kernel multiplies with (and the model's other weights)
_K_MULTIPLE = 16  # the kernel's inner dimension must be a multiple of this


def int8_available() -> bool:
    """Whether this torch has the weight-only int8 CPU kernel."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8 of a ``[out, in]`` weight: ``(q int8 [out, in], scales fp32 [out])``."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T`` for a 2-D `x` (any strides) in the scales' dtype."""
    y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight, scales)
    return y


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights ``[out, in]`` and one scale per output row (`quantize_weight`).

    `weight`, `scales` and `bias` are plain attributes (the fast path points them at rows of fused
    matrices, as it does with `torch.nn.Linear` parameters)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.scales = scales
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype: torch.dtype = INT8_COMPUTE_DTYPE) -> Int8Linear:
        q, scales = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(q, scales.to(dtype), bias)

    def dequantized(self) -> torch.Tensor:
        """The weight the product uses, as a float matrix (for tests and comparisons)."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype)
        y = int8_linear(flat, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype = INT8_COMPUTE_DTYPE) -> int:
    """Replace (in place) every `torch.nn.Linear` of `model` except its output embedding (`lm_head`)
    with an `Int8Linear` computing in `dtype`; the rest of the model is cast to `dtype`. Linears whose
    input size the kernel does not take stay float. Returns how many were quantized."""
    if not int8_available():
        raise RuntimeError("this torch has no weight-only int8 kernel (torch.ops.aten._weight_int8pack_mm)")
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not output and module.in_features % _K_MULTIPLE == 0
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear.from_linear(module, dtype))
    model.to(dtype)  # embeddings, norms, lm_head and any linear left float; int8 buffers are attributes
    return len(targets)
