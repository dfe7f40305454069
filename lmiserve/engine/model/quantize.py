"""Weight-only quantized linear layers on CPU: int8 through torch's own kernel, int4 and q8 through
lmiserve's compiled ones (`group_kernels`, numba):

- ``dtype=int8``: per-output-channel symmetric int8 weights, products in bf16
  (``torch.ops.aten._weight_int8pack_mm``); the rest of the model runs in bf16.
- ``dtype=int4``: 4-bit weights in groups of 32 inputs with a fp32 scale and minimum each (GGUF's
  Q4_1), products in fp32 through lmiserve's compiled kernel (`group_kernels.q4_linear`, which reads
  the weights once for all rows). The rest of the model (embeddings, norms, attention, KV cache)
  stays fp32; the output projection is fp32 or `Q8Linear` (models/int4_load.py). Quantizing a model
  that was Q4_1 (the bundled GGUF) finds its 4-bit codes again exactly; `Int4Linear.from_codes`
  takes a file's own codes, scales and minimums.
- `Q8Linear`: int8 codes with a fp32 scale per group of 32 (or 16) inputs (GGUF's Q8_0), fp32
  products (`group_kernels.q8_linear`): an int4 model's output projection (`quantize_output_q8`,
  `install_output_q8`), and its layer linears a GGUF file holds as Q8_0, Q6_K or Q5_0
  (models/int4_load.py; the fast forward runs any mix of int4 and q8 layer linears).

Why: decoding a few rows reads every weight once a step, so at small batches a step costs about the
bytes it reads. int8 weights are a quarter of fp32's (half of bf16's), int4 an eighth. `quantize_linears`
and `quantize_linears_int4` leave the output projection float (the vocabulary matrix is tied to the
embeddings in most small models); an int4 model's is made `Q8Linear` separately, untied (8 bits: what
llama.cpp's quantizers keep for it), and a draft's int8 (`quantize_output_int8`).

int8: for each output row ``scale = max|w| / 127`` and ``q = round(w / scale)`` clamped to
``[-127, 127]`` (symmetric, no zero point); the kernel computes ``x @ (q * scale).T`` with fp32
accumulation and rounds the result to bf16. The kernel needs ``in_features`` a multiple of 16 (it
crashes otherwise, torch 2.13): other linears are left in bf16.

int4: `int4_codes` (Q4_1's rule), stored in `group_kernels`' blocked layout (blocks of
`INT4_ROW_BLOCK` = 16 output rows; a partial last block is padded); inputs a multiple of 32, others
left fp32.

`quantize_linears` / `quantize_linears_int4` swap the model's `torch.nn.Linear` modules for
`Int8Linear` / `Int4Linear` in place, so the transformers forward (`generate`, the generic runner)
and lmiserve's fast forward read the same quantized weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmiserve.engine.model import group_kernels, input_order, int4_triton
from lmiserve.engine.model.codes_linear import CodesLinear
from lmiserve.engine.model.fp8_ops import fp8_linear
from lmiserve.engine.model.group_kernels import (
    LANES,
    blocked,
    pack_q4,
    pack_q8,
    q4_linear,
    q8_linear,
    unpack_q4,
    unpack_q8,
)
from lmiserve.engine.model.int4_triton import Int4Scales
from lmiserve.engine.model.int8_weights import Int8Scales, int8_weight_linear

INT8_COMPUTE_DTYPE = torch.bfloat16  # what the int8 kernel multiplies with (and the model's other weights)
INT8_K_MULTIPLE = 16  # the kernel's inner dimension must be a multiple of this
INT4_GROUP = 32  # inputs per int4 scale/minimum (GGUF Q4_1's block)
INT4_ROW_BLOCK = LANES  # int4 and q8 weights are stored in blocks of this many output rows
Q8_GROUP = 32  # inputs per q8 scale (GGUF Q8_0's block)


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
    """Whether the int4 (and q8) CPU kernels can run (`group_kernels`: numba)."""
    return group_kernels.available()


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


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` (fp32) for a 2-D `x` with int4 weights in `group_kernels`' blocked layout (every row
    of the blocks: a padded last block's zero rows too)."""
    return q4_linear(x, packed, scales)


def quantized_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | Int4Scales | Int8Scales | input_order.InputOrder
) -> torch.Tensor:
    """The product of a quantized weight, by its storage (`input_order.InputOrder`: codes whose inputs are stored
    in group order, the rows gathered first): AWQ/GPTQ codes on CUDA (`Int4Scales`,
    `int4_triton.int4_linear`), 8-bit integer codes on CUDA (`Int8Scales`, `int8_weights`), blocked int4 (uint8,
    `int4_linear`), fp8 rows (`quant_formats.fp8_linear`), blocked q8 (int8 or fp8 codes with 2-D fp32 group
    scales, ``[out / 16, in * 16]``, `group_kernels.q8_linear`), or int8 rows (`int8_linear`)."""
    if isinstance(scales, input_order.InputOrder):
        return quantized_linear(input_order.gathered(x, scales.order), weight, scales.scales)
    if isinstance(scales, Int4Scales):
        return int4_triton.int4_linear(x, weight, scales)
    if isinstance(scales, Int8Scales):
        return int8_weight_linear(x, weight, scales)
    if weight.dtype == torch.uint8:
        return int4_linear(x, weight, scales)
    if weight.dtype == torch.float8_e4m3fn and not blocked(weight, x.shape[-1]):  # quant_formats.Fp8Linear's rows
        return fp8_linear(x, weight, scales)
    if scales.dim() == 2:
        return q8_linear(x, weight, scales)
    # int8 products run in the scales' dtype (bf16): a float32 input (a draft's output projection) too
    return int8_linear(x if x.dtype == scales.dtype else x.to(scales.dtype), weight, scales)


class Int8Linear(CodesLinear):
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

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return int8_linear(rows.to(self.scales.dtype), self.weight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


class Int4Linear(CodesLinear):
    """A linear layer with int4 weights in groups of 32 inputs, each with a fp32 scale and minimum
    (GGUF Q4_1, ``w = code * scale + min``), in `group_kernels`' blocked layout: `weight` uint8 codes
    ``[ceil(out / 16), in * 8]`` and `scales` fp32 ``[ceil(out / 16), in]`` (`group_kernels.pack_q4`).
    Input in any float dtype, product fp32, output in the input's dtype (`codes_linear.in_rows_dtype`).

    `weight`, `scales` and `bias` are plain attributes (the fast path points them at row blocks of
    fused matrices, as it does with `torch.nn.Linear` parameters). `order`: the inputs' stored order (GPTQ's
    act-order, `input_order`; None: the checkpoint's)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int | None = None,
        order: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = weight.shape[0] * LANES if out_features is None else out_features
        self.weight = weight
        self.scales = scales
        self.bias = bias
        self.order = order

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor,
        bias: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From 4-bit codes (0..15, ``[out, in]``, any int type; a GGUF file's own) and fp32 ``scale`` /
        ``low`` (``[out, in / 32]``): ``w = code * scale + low``, taken as is; `order`: the stored inputs' order."""
        packed, scales = pack_q4(codes, scale, low)
        b = None if bias is None else bias.detach().float()
        return cls(packed, scales, b, codes.shape[1], codes.shape[0], order)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int4Linear:
        codes, scale, low = int4_codes(linear.weight)
        return cls.from_codes(codes, scale, low, None if linear.bias is None else linear.bias.detach().clone())

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes uint8 [out, in], scale fp32 [out, in / 32], low fp32 [out, in / 32])``."""
        return unpack_q4(self.weight, self.scales, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the product uses, as a float matrix (for tests and comparisons)."""
        codes, scale, low = self.codes()
        w = codes.float().view(self.out_features, -1, INT4_GROUP) * scale[..., None] + low[..., None]
        return input_order.in_checkpoint_order(w.view(self.out_features, self.in_features), self.order)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return q4_linear(input_order.gathered(rows, self.order), self.weight, self.scales, self.out_features)

    def extra_repr(self) -> str:
        groups = f"groups of {INT4_GROUP}{input_order.extra_repr(self.order)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 weights ({groups})"


class Q8Linear(CodesLinear):
    """A linear layer with 8-bit weights and a fp32 scale per group of 16 or 32 inputs (GGUF Q8_0: 32; ``w = code *
    scale``) in `group_kernels`' blocked layout: `weight` ``[ceil(out / 16), in * 16]``, int8 codes or fp8 e4m3fn values
    (an fp8 checkpoint's on a CPU, `cpu_codes.fp8_layer`), `scales` fp32 ``[ceil(out / 16), in / group * 16]``
    (`group_kernels.pack_q8`). Input in any float dtype, product fp32, output in the input's dtype
    (`codes_linear.in_rows_dtype`). A bias (fp32) and an `order` of the stored inputs (GPTQ's act-order, `input_order`)
    where a checkpoint's 8-bit codes have them (`cpu_codes.q8_layer`); a GGUF file's: neither."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = weight
        self.scales = scales
        self.bias = bias
        self.order = order

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        order: torch.Tensor | None = None,
    ) -> Q8Linear:
        """From 8-bit codes ``[out, in]`` (int8: a GGUF file's own, or a checkpoint's stored in `order`; fp8 e4m3fn:
        an fp8 checkpoint's) and fp32 scales ``[out, in / group]``."""
        packed, scales = pack_q8(codes, scale)
        b = None if bias is None else bias.detach().float()
        return cls(packed, scales, codes.shape[1], codes.shape[0], b, order)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear | torch.Tensor, group: int = Q8_GROUP) -> Q8Linear:
        """Q8_0's rule per group of `group` inputs: ``scale = max|w| / 127``, ``code = round(w / scale)``."""
        w = (linear.weight if isinstance(linear, torch.nn.Linear) else linear).detach().float()
        groups = w.view(w.shape[0], -1, group)
        scale = groups.abs().amax(dim=-1) / 127.0
        inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        codes = torch.round(groups * inverse[..., None]).clamp(-127, 127).to(torch.int8)
        return cls.from_codes(codes.view_as(w), scale)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8 or fp8 [out, in], scale fp32 [out, in / group])``."""
        return unpack_q8(self.weight, self.scales, self.out_features)

    def dequantized(self) -> torch.Tensor:
        codes, scale = self.codes()
        w = (codes.float().view(self.out_features, scale.shape[1], -1) * scale[..., None]).view(codes.shape)
        return input_order.in_checkpoint_order(w, self.order)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return q8_linear(input_order.gathered(rows, self.order), self.weight, self.scales, self.out_features)

    def extra_repr(self) -> str:
        group = f"groups of {self.in_features * LANES // self.scales.shape[1]}{input_order.extra_repr(self.order)}"
        kind = "fp8" if self.weight.dtype == torch.float8_e4m3fn else "q8"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} weights ({group})"


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype = INT8_COMPUTE_DTYPE) -> int:
    """Replace (in place) every `torch.nn.Linear` of `model` except its output embedding (`lm_head`)
    with an `Int8Linear` computing in `dtype`; the rest of the model is cast to `dtype`. Linears whose
    input size the kernel does not take stay float. Returns how many were quantized."""
    if not int8_available():
        raise RuntimeError("this torch has no weight-only int8 kernel (torch.ops.aten._weight_int8pack_mm)")
    count = replace_linears(
        model,
        lambda m: m.in_features % INT8_K_MULTIPLE == 0,
        lambda m: Int8Linear.from_linear(m, dtype),
    )
    model.to(dtype)  # embeddings, norms, lm_head and any linear left float; int8 buffers are attributes
    return count


def quantize_linears_int4(model: torch.nn.Module) -> int:
    """Replace (in place) every `torch.nn.Linear` of `model` except its output embedding with an
    `Int4Linear`; the rest of the model keeps its dtype. Linears whose inputs are not a multiple of 32
    stay float. Returns how many were quantized."""
    if not int4_available():
        raise RuntimeError("dtype int4 needs numba (lmiserve's int4 CPU kernel)")
    return replace_linears(model, lambda m: m.in_features % INT4_GROUP == 0, Int4Linear.from_linear)


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
    if type(head) is not torch.nn.Linear or head.in_features % INT8_K_MULTIPLE or not int8_available():
        return False
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False
    model.set_output_embeddings(Int8Linear.from_linear(head))  # type: ignore[operator]
    return True


def install_output_q8(model: torch.nn.Module, codes: torch.Tensor, scale: torch.Tensor) -> Q8Linear:
    """Make a `Q8Linear` of int8 `codes` ``[vocab, hidden]`` and fp32 `scale` ``[vocab, hidden /
    group]`` (a GGUF file's Q8_0 token embedding) `model`'s output projection, untied from the input
    embeddings (which keep their weights). In an int4 model the vocabulary matrix is the largest
    product of a decode step (SmolLM2-135M: 113 MB in fp32, 30 MB in q8)."""
    head = Q8Linear.from_codes(codes, scale)
    config = getattr(model, "config", None)
    if config is not None:
        config.tie_word_embeddings = False
    model.set_output_embeddings(head)  # type: ignore[operator]
    return head


def quantize_output_q8(model: torch.nn.Module, group: int = Q8_GROUP) -> bool:
    """Replace (in place) `model`'s output projection with a `Q8Linear` (Q8_0's rule per group of
    `group` inputs), untied from the input embeddings. False (nothing changed) when the projection is
    not a plain bias-free linear with inputs a multiple of `group`, or the kernel cannot run."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if type(head) is not torch.nn.Linear or head.bias is not None or head.in_features % group or not int4_available():
        return False
    quantized = Q8Linear.from_linear(head, group)
    install_output_q8(model, *quantized.codes())
    return True


def replace_linears(
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
