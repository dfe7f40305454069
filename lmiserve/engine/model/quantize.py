"""Weight-only quantized linear layers on CPU, through torch's own kernels (no extra package):

- ``dtype=int8``: per-output-channel symmetric int8 weights, products in bf16
  (``torch.ops.aten._weight_int8pack_mm``); the rest of the model runs in bf16.
- ``dtype=int4``: 4-bit weights in groups of 32 inputs with a scale and a minimum each, the layout
  of GGUF's Q4_1 (``torch.ops.aten._weight_int4pack_mm_for_cpu``). The rest of the model (embeddings,
  norms, attention, KV cache, output projection) stays fp32; only the products' inputs and outputs
  pass through bf16, the one type the kernel runs fast. Quantizing a model that was Q4_1 (the bundled
  GGUF) finds its 4-bit codes again exactly: only the scales and minimums round to bf16.

Why: decoding a few rows reads every weight once a step, so at small batches a step costs about the
bytes it reads. int8 weights are a quarter of fp32's (half of bf16's), int4 an eighth. The output
projection is never quantized (the vocabulary matrix is tied to the embeddings in most small models;
quantizing it changes the logits the most).

int8: for each output row ``scale = max|w| / 127`` and ``q = round(w / scale)`` clamped to
``[-127, 127]`` (symmetric, no zero point); the kernel computes ``x @ (q * scale).T`` with fp32
accumulation and rounds the result to bf16. The kernel needs ``in_features`` a multiple of 16 (it
crashes otherwise, torch 2.13): other linears are left in bf16.

int4: `int4_codes` (Q4_1's rule), packed by torch for its kernel; inputs a multiple of 32, outputs a
multiple of 16, others left fp32. The packing works on blocks of `INT4_ROW_BLOCK` output rows.

`quantize_linears` / `quantize_linears_int4` swap the model's `torch.nn.Linear` modules for
`Int8Linear` / `Int4Linear` in place, so the transformers forward (`generate`, the generic runner)
and lmiserve's fast forward read the same quantized weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT8_COMPUTE_DTYPE = torch.bfloat16  # what the int8 kernel multiplies with (and the model's other weights)
_K_MULTIPLE = 16  # the kernel's inner dimension must be a multiple of this
INT4_GROUP = 32  # inputs per int4 scale/minimum (GGUF Q4_1's block)
INT4_KERNEL_DTYPE = torch.bfloat16  # the int4 kernel is fast in bf16 only (fp32/fp16 run a slow reference path)
_INT4_OUT_MULTIPLE = 16  # the kernel's output rows must be a multiple of this
INT4_ROW_BLOCK = 64  # the CPU packing packs 64 output rows at a time (a partial last block differently)


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


def int4_available() -> bool:
    """Whether this torch has the weight-only int4 CPU kernel."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of `INT4_GROUP` inputs of a ``[out, in]`` weight as 4-bit codes with a scale and a
    minimum each (GGUF Q4_1: ``scale = (max - min) / 15``, ``q = round((w - min) / scale)``):
    ``(packed uint8 [out, in / 2], scales_and_zeros bf16 [in / 32, out, 2])`` in the kernel's form,
    whose value is ``(q - 8) * scale + zero`` with ``zero = min + 8 * scale``."""
    q, scale, low = int4_codes(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    zero = low + 8.0 * scale
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(INT4_KERNEL_DTYPE)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of a ``[out, in]`` weight: codes ``q`` (int32 0..15, ``[out, in]``), and per group of
    `INT4_GROUP` inputs its scale and minimum (fp32 ``[out, in / 32]``), ``w ~ q * scale + min``."""
    w = weight.detach().float()
    out, inputs = w.shape
    groups = w.view(out, inputs // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(out, inputs), scale, low


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a 2-D `x` with int4 weights (`quantize_int4`), in bf16, returned in x's dtype."""
    group = x.shape[-1] // scales_and_zeros.shape[0]
    y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(INT4_KERNEL_DTYPE).contiguous(), packed, group, scales_and_zeros
    )
    return y.to(x.dtype)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The product of a quantized weight, by its storage: int8 rows (`int8_linear`) or packed int4
    (uint8, `int4_linear`)."""
    if weight.dtype == torch.uint8:
        return int4_linear(x, weight, scales)
    # int8 products run in the scales' dtype (bf16): a float32 input (a draft's output projection) too
    return int8_linear(x if x.dtype == scales.dtype else x.to(scales.dtype), weight, scales)


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


class Int4Linear(torch.nn.Module):
    """A linear layer with int4 weights in groups of 32 inputs (`quantize_int4`); input and output in
    the caller's dtype (the product itself in bf16).

    `weight` (packed uint8 ``[out, in / 2]``), `scales` (``[in / 32, out, 2]``, contiguous) and `bias`
    are plain attributes, as in `Int8Linear`."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.weight = weight
        self.scales = scales
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int4Linear:
        packed, scales = quantize_int4(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scales, bias, linear.in_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the product uses, as a float matrix (for tests and comparisons)."""
        eye = torch.eye(self.in_features, dtype=INT4_KERNEL_DTYPE)
        return int4_linear(eye, self.weight, self.scales).float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_linear(x.reshape(-1, self.in_features), self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 weights (groups of {INT4_GROUP})"
        )


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype = INT8_COMPUTE_DTYPE) -> int:
    """Replace (in place) every `torch.nn.Linear` of `model` except its output embedding (`lm_head`)
    with an `Int8Linear` computing in `dtype`; the rest of the model is cast to `dtype`. Linears whose
    input size the kernel does not take stay float. Returns how many were quantized."""
    if not int8_available():
        raise RuntimeError("this torch has no weight-only int8 kernel (torch.ops.aten._weight_int8pack_mm)")
    count = _replace_linears(
        model,
        lambda m: m.in_features % _K_MULTIPLE == 0,
        lambda m: Int8Linear.from_linear(m, dtype),
    )
    model.to(dtype)  # embeddings, norms, lm_head and any linear left float; int8 buffers are attributes
    return count


def quantize_linears_int4(model: torch.nn.Module) -> int:
    """Replace (in place) every `torch.nn.Linear` of `model` except its output embedding with an
    `Int4Linear`; the rest of the model keeps its dtype. Linears whose sizes the kernel does not take
    (inputs not a multiple of 32, outputs not a multiple of 16) stay float. Returns how many were
    quantized."""
    if not int4_available():
        raise RuntimeError("this torch has no weight-only int4 CPU kernel (torch.ops.aten._weight_int4pack_mm_for_cpu)")
    return _replace_linears(
        model,
        lambda m: m.in_features % INT4_GROUP == 0 and m.out_features % _INT4_OUT_MULTIPLE == 0,
        Int4Linear.from_linear,
    )


def quantize_output_int8(model: torch.nn.Module) -> bool:
    """Replace (in place) `model`'s output projection with an `Int8Linear` (per-row int8, products in
    bf16), untied from the input embeddings (which keep their weights). For a speculative decoding
    draft: in a small int4 model the vocabulary matrix is the largest product of a decode step
    (SmolLM2-135M: 113 MB in fp32, against 53 MB for every other linear in int4; at one row on the AMD
    EPYC 3.6 ms through `cpu_gemm`, 1.8 ms in int8), and a draft's logits need only rank its best token
    (int4 there lost a quarter of the accepted drafts). False (nothing changed) when the projection is
    not a plain linear the kernel takes."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if type(head) is not torch.nn.Linear or head.in_features % _K_MULTIPLE or not int8_available():
        return False
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False
    model.set_output_embeddings(Int8Linear.from_linear(head))  # type: ignore[operator]
    return True


def _replace_linears(
    model: torch.nn.Module,
    takes: Callable[[torch.nn.Linear], bool],
    make: Callable[[torch.nn.Linear], torch.nn.Module],
) -> int:
    """Replace (in place) every plain `torch.nn.Linear` of `model` but its output embedding that the
    kernel `takes` with `make(linear)`; how many were replaced."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not output and takes(module)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
    return len(targets)
