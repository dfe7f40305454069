"""A checkpoint's integer codes kept on a CPU's kernels (AWQ, GPTQ, compressed-tensors' W4A16, W8A16 and W8A8;
`quant_formats.int4_module` and `int8_module` ask `layer` first on a CPU): each weight exactly the checkpoint's.

- 4-bit codes whose groups are runs of a multiple of 32 inputs: `quantize.Int4Linear` (lmiserve's
  int4 kernel, GGUF Q4_1's ``w = code * scale + min`` per group of 32: each group of 128 is 4 groups of 32 with
  ``min = -zero * scale``).
- Symmetric 8-bit codes (GPTQ-Int8, W8A16, W8A8's) whose groups are runs of a multiple of 16 inputs, or one scale a
  channel: `quantize.Q8Linear` (the q8 kernel of GGUF's Q8_0, ``w = code * scale`` per group of 32
  or 16: each group's scale repeated over its groups of 32). Until 2026-12-06 these were de-quantized to fp32: 4 times
  their bytes (a Qwen2.5-7B GPTQ-Int8 about 30 GB).
- In bf16 (``dtype=bf16``), symmetric 8-bit codes with a scale a channel (W8A8's): `quantize.Int8Linear` on torch's
  int8 kernel instead.

- fp8 weights (compressed-tensors', FBGEMM's, ModelOpt's, block-wise fp8; ``quantize=fp8``'s):
  `quantize.Q8Linear` with fp8 e4m3fn values for codes (`fp8_layer`; the q8 kernel widens each byte exactly), the scale
  of a tensor or channel repeated over the row's groups of 32 (or 16), a block's over its groups. Until 2026-12-07
  these were de-quantized to fp32 at load: 4 times their bytes (a Llama 3.1 8B fp8 about 32 GB).

The kernels compute in fp32 whatever the model's dtype: with ``dtype=bf16`` the rows are widened and the output, bias
added, rounded to bf16 once (`codes_linear.in_rows_dtype`); until 2026-12-07 bf16 de-quantized all of these at load.

GPTQ's act-order groups are runs once the inputs are sorted by group (`input_order`): the layer stores them so and
gathers its activations. None where no kernel serves the codes: the caller de-quantizes them."""

from __future__ import annotations

from typing import Protocol

import torch

from lmiserve.engine.model import input_order, int8_weights
from lmiserve.engine.model.quantize import (
    INT4_GROUP,
    INT4_ROW_BLOCK,
    INT8_COMPUTE_DTYPE,
    INT8_K_MULTIPLE,
    Int4Linear,
    Int8Linear,
    Q8Linear,
    int4_available,
    int8_available,
)


class Int4Parts(Protocol):
    """What these layers read of `quant_formats.Int4Parts`."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    bits: int


Q8_GROUPS = (32, 16)  # the q8 kernel's groups of inputs, largest first


def layer(parts: Int4Parts, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Module | None:
    """The CPU's layer of `parts` (`bits` 4 or 8) computing in `dtype`, or None (de-quantize them). In bf16, 8-bit
    codes with a scale a channel take torch's int8 kernel (its products are bf16's); the others the kernels that
    widen to fp32 (their output rounded to `dtype`: `codes_linear.in_rows_dtype`)."""
    if parts.bits == 4:
        return int4_layer(parts, bias)
    rows = int8_rows_layer(parts, bias) if dtype == INT8_COMPUTE_DTYPE else None
    return rows if rows is not None else q8_layer(parts, bias)


def int4_layer(parts: Int4Parts, bias: torch.Tensor | None) -> Int4Linear | None:
    """4-bit codes on the int4 kernel (fp32), or None."""
    ordered, order, size = input_order.in_group_order(parts)
    if size is None or size % INT4_GROUP or not int4_available():
        return None
    return Int4Linear.from_codes(ordered.codes, *q4_runs(parts.scale, parts.zero, size), bias, order)


def q4_runs(scale: torch.Tensor, zero: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros ``[out, groups]`` of runs of `size` inputs (``w = (code - zero) * scale``, `size` a multiple
    of 32) as the int4 kernel's scale and minimum a group of 32 (``w = code * scale + min``), fp32."""
    repeat = size // INT4_GROUP
    scale = scale.float()
    return scale.repeat_interleave(repeat, dim=1), (-zero.float() * scale).repeat_interleave(repeat, dim=1)


def q8_layer(parts: Int4Parts, bias: torch.Tensor | None) -> Q8Linear | None:
    """Symmetric 8-bit codes on the q8 kernel (fp32), or None (asymmetric codes; groups of another size; outputs not
    whole blocks of `INT4_ROW_BLOCK` rows, which the fast path does not take)."""
    if not _symmetric(parts) or parts.codes.shape[0] % INT4_ROW_BLOCK or not int4_available():
        return None
    ordered, order, size = input_order.in_group_order(parts)
    group = q8_group(size)
    if size is None or group is None:
        return None
    scale = parts.scale.float().repeat_interleave(size // group, dim=1)
    return Q8Linear.from_codes(int8_weights.signed_codes(ordered.codes), scale, bias, order)


def fp8_layer(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Q8Linear | None:
    """fp8 e4m3fn weights ``[out, in]`` on the q8 kernel (fp32), or None (inputs not a multiple of 16, or blocks of
    scales that are not; outputs not whole blocks of `INT4_ROW_BLOCK` rows; no kernel). `scale`: one (a tensor's),
    ``[out]`` or ``[out, 1]`` (a channel's), or ``[out, blocks]`` (each row's block scales, blocks of
    ``in / blocks`` inputs)."""
    out, inputs = weight.shape
    if weight.dtype != torch.float8_e4m3fn or out % INT4_ROW_BLOCK or not int4_available():
        return None
    rows = scale.float().reshape(out, -1) if scale.numel() > 1 else scale.float().reshape(1, 1).expand(out, 1)
    scales = q8_runs(rows, inputs)
    return None if scales is None else Q8Linear.from_codes(weight, scales, bias)


def q8_runs(rows: torch.Tensor, inputs: int) -> torch.Tensor | None:
    """Scales ``[out, runs]`` of runs of equal size over `inputs` inputs (one run: a channel's) repeated over the q8
    kernel's groups (`q8_group`), or None where a run is not whole groups of 16."""
    size = inputs // rows.shape[1]
    group = q8_group(size) if size * rows.shape[1] == inputs else None
    return None if group is None else rows.repeat_interleave(size // group, dim=1)


def q8_group(size: int | None) -> int | None:
    """The q8 kernel's group (32, else 16) that divides runs of `size` inputs sharing a scale, or None."""
    return next((g for g in Q8_GROUPS if size is not None and size % g == 0), None)


def int8_rows_layer(parts: Int4Parts, bias: torch.Tensor | None) -> Int8Linear | None:
    """Symmetric 8-bit codes with a scale a channel on torch's int8 kernel (bf16), or None."""
    inputs = parts.codes.shape[1]
    if parts.scale.shape[1] != 1 or not _symmetric(parts) or inputs % INT8_K_MULTIPLE or not int8_available():
        return None
    dtype = INT8_COMPUTE_DTYPE
    weight = int8_weights.signed_codes(parts.codes)
    return Int8Linear(weight, parts.scale[:, 0].to(dtype), None if bias is None else bias.detach().to(dtype))


def _symmetric(parts: Int4Parts) -> bool:
    return bool((parts.zero == int8_weights.SYMMETRIC_ZERO).all())
