"""Act-order weights (GPTQ's ``desc_act``) kept as codes by reading their inputs in group order.

GPTQ with ``desc_act`` quantizes a linear's inputs in order of importance, so the group of input i (``g_idx[i]``)
is not ``i // group_size``: each group's inputs are scattered. The kernels that read groups as runs of consecutive
inputs (the CPU's int4 kernel, `quantize.Int4Linear`; `fp8_gemv`'s kernel for 8-bit codes on a GPU,
`int8_weights.Int8WeightLinear`) could not serve them, and such a layer was de-quantized at load: on a CPU in fp32,
8 times the bytes of its 4-bit codes (a Llama 3.1 8B GPTQ with act-order: about 32 GB, more than many hosts have).

Here the layer stores its inputs sorted by group (`in_group_order`: a permutation of the codes' columns, made once at
load), where every group then is a run of one size; its product gathers the activations in that order first
(`gathered`: one ``index_select`` of the rows, a row of the hidden size a token), which gives the same sums as the
layer in its checkpoint's order. The fast path fuses such layers only with layers of the same order (`key`: q/k/v,
and gate/up, read the same input and GPTQ gives them the same order) and carries the order with the fused scales
(`InputOrder`, `quantize.quantized_linear` gathers; `scales_of` reads the scales beneath). The CPU's packed decode
kernels (`q4_decode`) gather each product's input too, the norms' weights taken in the same order. AWQ/GPTQ codes on
a GPU (`int4_triton`) gather in their own kernel and do not use this."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from lmiserve.engine.model import int4_triton


class InputOrder(NamedTuple):
    """A fused product's `scales` (a CPU int4 block's tensor, or a GPU's `int8_weights.Int8Scales`) over codes whose
    inputs are stored in `order` (int64 ``[in]``: stored input j is the layer's input ``order[j]``)."""

    scales: Any
    order: torch.Tensor


class Codes(Protocol):
    """What `in_group_order` reads of `quant_formats.Int4Parts` (a dataclass)."""

    codes: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor


P = TypeVar("P", bound=Codes)


def in_group_order(parts: P) -> tuple[P, torch.Tensor | None, int | None]:
    """``(parts, order, size)``: `parts` with its inputs stored sorted by group and that `order`, where that makes its
    groups runs of one `size` (GPTQ's act-order); else `parts` as they are, no order, and the size of their groups'
    runs (None: groups of unequal sizes, as a tensor-parallel rank's part of act-ordered inputs)."""
    order, size = int4_triton.group_layout(parts.g_idx, parts.scale.shape[1])
    if order is None:
        return parts, None, size
    codes, g_idx = parts.codes[:, order].contiguous(), parts.g_idx[order]
    return dataclasses.replace(parts, codes=codes, g_idx=g_idx), order, size  # type: ignore[type-var]


def gathered(rows: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """`rows` ``[n, in]`` with their inputs in the stored `order` (None: as they are)."""
    return rows if order is None else rows.index_select(-1, order)


def in_checkpoint_order(weight: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A de-quantized ``[out, in]`` `weight` whose columns are stored in `order`, in the checkpoint's input order."""
    return weight if order is None else weight[:, torch.argsort(order)]


def key(module: Any) -> tuple[int, ...] | None:
    """What layers fuse on besides their kind: the order of their stored inputs (None: the checkpoint's)."""
    order = getattr(module, "order", None)
    return None if order is None else tuple(order.tolist())


def scales_of(scales: Any) -> Any:
    """A product's scales beneath its input order (`InputOrder`), or `scales` as they are."""
    return scales.scales if isinstance(scales, InputOrder) else scales


def with_order(scales: Any, module: Any) -> Any:
    """The `scales` of a product of `module`'s codes (fused with others of its `key`) as `quantize.quantized_linear`
    takes them: with the order of its stored inputs where it has one (`InputOrder`)."""
    order = getattr(module, "order", None)
    return scales if order is None else InputOrder(scales, order)


def extra_repr(order: torch.Tensor | None) -> str:
    return "" if order is None else ", inputs in group order"
