"""8-bit integer weights kept as codes on a GPU (issue #39): compressed-tensors' W8A8 (``int-quantized``) and W8A16
(``pack-quantized``, 8 bits) checkpoints, RedHatAI's ``quantized.w8a8`` releases among them.

Why: until this module a GPU de-quantized such a checkpoint to bf16 at load, which doubles its memory. A 70B W8A8
model (70 GB of codes) then needs 140 GB and fails to load on one 80 GB GPU where its codes would fit. So the loader
keeps the codes where de-quantized they would take more than `weight_fit.FIT_SHARE` of the GPU's free memory, or
where ``LMISERVE_USE_TRITON_INT8=1`` forces it (``0``: always de-quantized); `weights_kept_for` says which, in the
log (`weight_fit.kept_for`). Elsewhere they are de-quantized as before: the bf16 products are the ones measured.

Kept codes run `fp8_gemv`'s weight-only Triton kernel, which reads an int8 weight as it reads fp8 bytes (each code
converted exactly in registers; ``INT8`` in `fp8_gemv_kernel`) and applies the scales per output channel, or by
groups of inputs (each row's ``[out, groups]``, a group a power of two: `fp8_gemv.input_block`). Its tiles are
measured per weight shape and row bucket against the weight de-quantized a slice at a time
(`fp8_gemv.dequantized_product`), which serves where no tile passes or is faster, at every row count (prompts
too): int8 codes never go to ``torch._scaled_mm``. A W8A8 checkpoint's codes (int8 activations,
`Int8Scales.int8_rows`) have one more candidate there: `int8_w8a8`'s, the rows quantized to int8 for cuBLAS's
integer product. Elsewhere, as on a CPU (`quant_formats.int8_module`), the products take the activations in the
compute dtype.

`Int8WeightLinear` holds the codes ``[out, in]`` int8 (``code - 128`` of `quant_formats.Int4Parts`' 8-bit codes)
and `Int8Scales`; the fast path fuses q/k/v and gate/up of such layers (`llama_layout`) and runs them by the scales'
type (`quantize.quantized_linear`). Served: symmetric codes (zero 128) whose groups are runs of consecutive inputs
of a power of two, or one scale a channel; act-ordered groups (GPTQ-Int8's ``desc_act``) stored in group order, the
rows gathered first (`input_order`). Others (an asymmetric W8A16) are de-quantized at load. Not yet run on a GPU:
the GPU check's engine tests run it there (``LMISERVE_USE_TRITON_INT8=1``)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from lmiserve.engine.model import fp8_gemv, input_order, kernel_choice, weight_fit
from lmiserve.engine.model.codes_linear import CodesLinear
from lmiserve.engine.model.fp8_ops import fp8_linear

log = logging.getLogger(__name__)

__all__ = [
    "USE_ON_CUDA",
    "Int8Scales",
    "Int8WeightLinear",
    "fuse_int8",
    "int8_weight_linear",
    "served_scales",
    "signed_codes",
    "weights_kept_for",
]

# compressed-tensors' 8-bit codes on CUDA: True (LMISERVE_USE_TRITON_INT8=1) kept on the kernel; False (=0)
# de-quantized at load; None (unset) kept where de-quantized they would not fit (`weight_fit`)
USE_ON_CUDA = kernel_choice.switch("LMISERVE_USE_TRITON_INT8")
SYMMETRIC_ZERO = 128  # the stored zero of a symmetric 8-bit code (`Int4Parts`' codes are the signed code + 128)


class Int8Scales(NamedTuple):
    """An `Int8WeightLinear`'s fp32 scales: ``[out]`` (a channel's) or ``[out, groups]`` (each row's by groups of
    inputs); a type of its own, so the fast path tells them from the CPU's int8 scales (`quantize.quantized_linear`).
    `int8_rows`: the checkpoint quantizes the activations to int8 (W8A8), so `int8_w8a8`'s product is a candidate."""

    scales: torch.Tensor
    int8_rows: bool = False


def signed_codes(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes as stored in `quant_formats.Int4Parts` (uint8, the signed code + `SYMMETRIC_ZERO`) as the signed
    int8 codes ``[out, in]`` the kernels read (contiguous)."""
    return (codes.to(torch.int16) - SYMMETRIC_ZERO).to(torch.int8).contiguous()


def int8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scales: Int8Scales) -> torch.Tensor:
    """``x @ (weight * scales).T`` in `x`'s dtype for a 2-D `x` and int8 codes ``[out, in]``: `fp8_gemv`'s kernel
    where a tile is chosen, else the de-quantized product (`fp8_ops.fp8_linear`)."""
    return fp8_linear(x, weight, scales.scales, int8_rows=scales.int8_rows)


def served_scales(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int | None
) -> torch.Tensor | None:
    """The kernel's fp32 scales (``[out]``, or ``[out, groups]``) of 8-bit `codes` ``[out, in]`` with `scale` and
    `zero` ``[out, groups]`` whose groups are runs of `group_size` inputs (None: not runs); None where the kernel
    does not serve them (zeros not symmetric, or groups whose size `fp8_gemv.input_block` cannot read from the
    scales' shape)."""
    if group_size is None or not bool((zero == SYMMETRIC_ZERO).all()):
        return None
    if scale.shape[1] == 1:
        return scale[:, 0].float().contiguous()
    served = scale.float().contiguous()
    return served if fp8_gemv.input_block(codes.shape[1], served) == group_size else None


class Int8WeightLinear(CodesLinear):
    """A linear layer of int8 codes ``weight`` ``[out, in]`` and `Int8Scales`, on `fp8_gemv`'s kernel (module doc).
    `weight`, `scales` and `bias` are plain attributes (not parameters: ``Module.to(dtype)`` would cast the codes),
    which the fast path points at rows of its fused matrices. `order`: the inputs' stored order (GPTQ's act-order,
    `input_order`; None: the checkpoint's)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        int8_rows: bool = False,
        order: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.scales = Int8Scales(scales, int8_rows)
        self.bias = bias
        self.order = order

    def dequantized(self) -> torch.Tensor:
        return input_order.in_checkpoint_order(fp8_gemv.dequantized_weight(self.weight, self.scales.scales), self.order)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return int8_weight_linear(input_order.gathered(rows, self.order), self.weight, self.scales)

    def extra_repr(self) -> str:
        group = fp8_gemv.input_block(self.in_features, self.scales.scales)
        scales = f"scales by groups of {group} inputs" if group else "a scale a channel"
        rows = (", int8 activations" if self.scales.int8_rows else "") + input_order.extra_repr(self.order)
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 codes ({scales}{rows})"


def fuse_int8(
    modules: list[Int8WeightLinear], bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, Int8Scales]:
    """`llama_layout`'s fusion of `modules` (q/k/v, or gate/up; their scales of one layout) with their fused `bias`:
    the codes' rows and the scales' rows concatenated; each module pointed at its rows."""
    weight = torch.cat([m.weight for m in modules], dim=0) if len(modules) > 1 else modules[0].weight
    scales = torch.cat([m.scales.scales for m in modules], dim=0) if len(modules) > 1 else modules[0].scales.scales
    int8_rows = modules[0].scales.int8_rows  # (one checkpoint's: the same for all)
    row = 0
    for m in modules:
        n = m.out_features
        m.weight = weight[row : row + n]
        m.scales = Int8Scales(scales[row : row + n], int8_rows)
        m.bias = None if bias is None else bias[row : row + n]
        row += n
    return weight, bias, Int8Scales(scales, int8_rows)


def weights_kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool | None:
    """On CUDA where Triton runs (compute capability 8.0 or more), whether the 8-bit linears of `model` (on the meta
    device in the compute dtype: a whole model's, or a tensor-parallel rank's shell) keep their codes on the kernel
    (`weight_fit.kept_for`), logged for `name`; None elsewhere (a CPU: `quant_formats.int8_module`'s rule)."""
    if not weight_fit.triton_gpu(device):
        return None
    switch = "LMISERVE_USE_TRITON_INT8"
    return weight_fit.kept_for(log, model, device, name, USE_ON_CUDA, switch, "int8 codes on the Triton kernel")
