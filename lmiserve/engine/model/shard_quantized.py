"""A tensor-parallel rank's share of a quantized checkpoint (issue #39): each linear's shard cut from the
checkpoint's own tensors as `sharding` cuts a float linear's weight, then made as one process makes the whole
linear (`quant_formats`), so a rank of an fp8 checkpoint holds fp8 weights on Hopper and Ada GPUs.

- fp8 per channel or per tensor (compressed-tensors, FBGEMM fp8, AutoFP8): a column-parallel linear's rows of the
  fp8 weight with their scales (a per-tensor scale whole), a row-parallel linear's input columns with every
  scale, read by their slices; `fp8_module` makes an `Fp8Linear` where the device multiplies fp8, else
  dequantizes it (a CPU).
- 4-bit AWQ, GPTQ and compressed-tensors' ``pack-quantized``: the packed tensors read whole (a quarter of the bf16
  bytes), unpacked (`unpack_awq`, `unpack_gptq`, `unpack_packed`), then the codes, scales and zeros cut: a
  column-parallel linear's rows, a row-parallel linear's input columns with the groups they use (consecutive
  groups read as the finer groups whole in the rank's columns, `whole_groups`: the rank's layer is then the
  kernels' where one process's is, though its first input falls inside a group; GPTQ's act-order groups are
  kept as its ``g_idx`` says); `int4_module` makes the layer.
- ``quantize=fp8`` on a float checkpoint (`quantize_fp8_shard`): each rank's float linears quantized per output
  channel, a row-parallel linear's scales over its whole rows (their maxima all-reduced), so every rank's fp8
  weights are its cut of those one process makes.
- Block-wise fp8 (``weight_block_size``: Qwen3's and DeepSeek's FP8 releases) kept fp8 where asked
  (`_block_fp8_shard`): a column-parallel linear's rows with each row's block scales, a row-parallel linear's
  columns by the finer blocks whole in them (`whole_groups`).
- Any other fp8 weight (block-wise fp8 not kept, an expert's matrices, an output projection): read through
  `Fp8Scaled`, which dequantizes the slice asked for (its fp8 values times the scales of the blocks it covers), so
  every reader of a float checkpoint (the linears', the experts', the vocabulary's) reads it as float, as one
  process's load does for block-wise fp8.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from lmiserve.engine.model import fp8_gemv
from lmiserve.engine.model.fp8_ops import per_tensor_at_load
from lmiserve.engine.model.int4_triton import GROUP_TILE
from lmiserve.engine.model.language_model import text_part
from lmiserve.engine.model.packed_codes import stored_int_parts
from lmiserve.engine.model.quant_formats import (
    Int4Parts,
    QuantSpec,
    block_grid,
    fp8_module,
    int4_module,
    quantize_fp8,
    unpack_awq,
    unpack_gptq,
    weights_kept_for,
)
from lmiserve.engine.model.quantize import replace_linears
from lmiserve.engine.model.sharding import ROW_PARALLEL, ShardPlan, column_run, keep_runs, row_runs, shard_of

__all__ = [
    "Fp8Scaled",
    "cut_codes",
    "dequantizing_reader",
    "int4_parts",
    "quantize_fp8_shard",
    "shard_linear",
    "whole_groups",
]

Read = Callable[[str], Any]  # a checkpoint tensor's safetensors slice, by its name


class Fp8Scaled:
    """An fp8 weight ``[out, in]`` of a checkpoint read as float: a slice of it (``[rows]`` or ``[rows, columns]``,
    steps of one) is its fp8 values times the scale of the block each is in. `scale` ``[out / rows_a_block, in /
    inputs_a_block]`` (rounded up; block-wise fp8's ``weight_scale_inv``, or ModelOpt's ``weight_scale``:
    `block_grid`), ``[out, 1]`` (per channel) or one value (per tensor); `block`: the block's rows and inputs
    (None: what `scale`'s shape says of a per-channel or per-tensor scale)."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int] | None) -> None:
        self.weight = weight
        self.shape = tuple(weight.get_shape())
        self.scale = torch.as_tensor(scale[...]).float()
        if self.scale.dim() < 2:  # per tensor (one value) or per channel ([out])
            self.scale = self.scale.reshape(-1, 1)
        out, inputs = self.shape
        if block is not None:
            self.scale = block_grid(self.scale, self.shape, block)
        else:
            block = (1 if self.scale.shape[0] > 1 else out, inputs)
        self.block = block

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        if not isinstance(rows, slice) or not isinstance(columns, slice) or len(self.shape) != 2:
            raise ValueError(f"an fp8 weight of shape {list(self.shape)} is read by slices of its rows and columns")
        (r0, r1, r_step), (c0, c1, c_step) = rows.indices(self.shape[0]), columns.indices(self.shape[1])
        if r_step != 1 or c_step != 1:
            raise ValueError("an fp8 weight is read by runs of rows and columns")
        (bo, bi), (sr, sc) = self.block, (r0 % self.block[0], c0 % self.block[1])
        scale = self.scale[r0 // bo : -(-r1 // bo), c0 // bi : -(-c1 // bi)]
        scale = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[sr : sr + r1 - r0, sc : sc + c1 - c0]
        return torch.as_tensor(self.weight[r0:r1, c0:c1]).float() * scale


class Dequantized:
    """A weight de-quantized whole, read as a checkpoint's slice is (``get_shape()``, ``[rows, columns]``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.weight[index]


def dequantizing_reader(read: Read, names: Mapping[str, Any], quant: QuantSpec | None) -> Read:
    """`read`, but an fp8 checkpoint's weights (those with a ``weight_scale_inv`` or ``weight_scale`` in `names`)
    read as float through `Fp8Scaled`, and integer ones (AWQ's or GPTQ's ``qweight``, compressed-tensors'
    ``weight_packed`` or an int8 weight's ``weight_scale``, in `names`: a mixture of experts' matrices, which no linear
    of lmiserve's holds) de-quantized whole (`Dequantized`)."""
    if quant is not None and (quant.int_codes or quant.method in ("awq", "gptq")):

        def unpacking(name: str) -> Any:
            base, _, kind = name.rpartition(".")
            if kind != "weight" or f"{base}.{quant.codes_key}" not in names:
                return read(name)
            return Dequantized(int4_parts(base, names, read, quant).dequantize())

        return unpacking
    if quant is None or quant.method != "fp8":
        return read

    def reader(name: str) -> Any:
        base, _, kind = name.rpartition(".")
        if kind == "weight":
            for scale in ("weight_scale_inv", "weight_scale"):
                if f"{base}.{scale}" in names:
                    return Fp8Scaled(read(name), read(f"{base}.{scale}"), quant.blocks)
        return read(name)

    return reader


def shard_linear(
    name: str,
    names: Mapping[str, Any],
    read: Read,
    plan: ShardPlan | None,
    quant: QuantSpec,
    dtype: torch.dtype,
    device: torch.device,
    keep: bool | None = None,
) -> torch.nn.Module | None:
    """The rank's layer of linear `name` from the checkpoint's quantized tensors of it (`names`: the checkpoint's
    tensors; `read`: one's slice), cut as `sharding` cuts a float linear, or whole where `plan` is None (a module
    every rank keeps whole: a VLM's vision tower); None when the checkpoint stores it float or in a format that is
    read as float (block-wise fp8: `dequantizing_reader`; a whole one always). `keep`: `weights_kept_for`'s."""
    if quant.method == "fp8" and quant.blocks:
        return None if plan is None else _block_fp8_shard(name, names, read, plan, quant, dtype, device, keep)
    short = name.rpartition(".")[2]
    if quant.method != "fp8":  # integer codes: read whole, unpacked, then cut
        parts = int4_parts(name, names, read, quant)
        rows, columns = _cut_of(plan, short, tuple(parts.codes.shape))
        bias = _bias(read(f"{name}.bias") if f"{name}.bias" in names else None, rows, short, plan)
        return int4_module(cut_codes(parts, rows, columns), bias, dtype, device, keep)
    weight = read(f"{name}.weight")
    rows, columns = _cut_of(plan, short, tuple(weight.get_shape()))
    bias = _bias(read(f"{name}.bias") if f"{name}.bias" in names else None, rows, short, plan)
    scale = torch.as_tensor(read(f"{name}.weight_scale")[...])
    if rows is not None:
        weight = keep_runs(weight, rows)
        scale = scale if scale.numel() == 1 else keep_runs(scale, rows)
    else:
        weight = torch.as_tensor(weight[:, columns] if columns is not None else weight[:])
    return fp8_module(weight, scale, bias, dtype, device, keep)


def int4_parts(name: str, names: Mapping[str, Any], read: Read, quant: QuantSpec) -> Int4Parts:
    """The integer linear `name`'s codes, scales and zeros, whole, from its stored tensors (AWQ's, GPTQ's or
    compressed-tensors' integers)."""
    whole = _whole_reader(name, names, read)
    if quant.int_codes:
        return stored_int_parts(name, whole, quant)
    qweight, qzeros, scales = (cast(torch.Tensor, whole(key)) for key in ("qweight", "qzeros", "scales"))
    if quant.method == "awq":
        return unpack_awq(qweight, qzeros, scales, quant.group_size)
    return unpack_gptq(qweight, qzeros, scales, whole("g_idx"), quant.group_size, quant.v1_zeros, quant.code_bits)


def _whole_reader(name: str, names: Mapping[str, Any], read: Read) -> Callable[[str], torch.Tensor | None]:
    """The tensors of `name` read whole by their short names (``qweight``), None for those not stored."""

    def whole(key: str) -> torch.Tensor | None:
        return torch.as_tensor(read(f"{name}.{key}")[...]) if f"{name}.{key}" in names else None

    return whole


def _block_fp8_shard(
    name: str,
    names: Mapping[str, Any],
    read: Read,
    plan: ShardPlan,
    quant: QuantSpec,
    dtype: torch.dtype,
    device: torch.device,
    keep: bool | None,
) -> torch.nn.Module | None:
    """The rank's `Fp8Linear` of a block-wise fp8 linear the rank keeps fp8: its rows (any, each with its blocks'
    scales: `fp8_gemv.block_scales`' rows) or its input columns, by the finer blocks that start at its first
    input (`whole_groups`: each its block's scale); None where those would be under `LEAST_GROUP` inputs, or the
    blocks are not the kernel's (read as float, `dequantizing_reader`)."""
    short, block = name.rpartition(".")[2], cast(tuple[int, int], quant.blocks)
    weight = read(f"{name}.weight")
    outputs, inputs = weight.get_shape()
    stored = block_grid(torch.as_tensor(read(f"{name}.{quant.codes_key}")[...]), (outputs, inputs), block)
    scales = fp8_gemv.block_scales(stored, outputs, inputs, block)
    if scales is None:
        return None
    rows = row_runs(plan, short, outputs)
    bias = _bias(read(f"{name}.bias") if f"{name}.bias" in names else None, rows, short, plan)
    if rows is not None:
        return fp8_module(keep_runs(weight, rows), keep_runs(scales, rows), bias, dtype, device, keep)
    columns = column_run(plan, short, inputs) if short in ROW_PARALLEL else slice(0, inputs)
    if scales.dim() == 2:  # (else one block spans the inputs: a scale a row, whatever the cut)
        fine = whole_groups(block[1], columns.start)
        if not fine:
            return None
        first, repeat = columns.start // block[1], block[1] // fine  # (only the rank's blocks' scales repeated)
        scales = scales[:, first : -(-columns.stop // block[1])].repeat_interleave(repeat, dim=1)  # a finer block each
        at = first * repeat  # the finer block the repeated scales start at
        scales = scales[:, columns.start // fine - at : -(-columns.stop // fine) - at].contiguous()
    return fp8_module(torch.as_tensor(weight[:, columns]).contiguous(), scales, bias, dtype, device, keep)


LEAST_GROUP = 16  # the fewest inputs of the finer groups a rank's cut keeps its format by (`whole_groups`)


def whole_groups(size: int, *edges: int, least: int = LEAST_GROUP) -> int:
    """The inputs of the finer groups that a row-parallel rank's input columns are read by so that it keeps its
    format: the most that divides the checkpoint's groups or blocks of `size` inputs and each of `edges` (the rank's
    first input; for codes, whose groups the kernels read whole, its count too). Each finer group takes its stored
    group's scale (and zero). 0 where that is under `least` (`LEAST_GROUP`; 4-bit codes: the int4 kernels'
    `GROUP_TILE`): the cut is then read by its own groups (the Triton int4 kernel pads them to one size,
    `int4_triton.padded_layout`; else de-quantized). A Qwen2-72B-based AWQ checkpoint over 4 ranks: `down_proj`'s
    29568 inputs are 7392 a rank, 57.75 groups of 128, read as 231 groups of 32 (vLLM refuses that split:
    vllm-project/vllm#5675)."""
    fine = math.gcd(size, *edges)
    return fine if fine >= least else 0


def _cut_of(plan: ShardPlan | None, short: str, shape: tuple[int, ...]) -> tuple[list[slice] | None, slice | None]:
    """The rows (column-parallel) or input columns (row-parallel) the rank keeps of a linear named `short` whose
    weight is ``[out, in]`` `shape`; neither for one kept whole (`plan` None, or a linear tensor parallelism does not
    cut)."""
    rows = None if plan is None else row_runs(plan, short, shape[0])
    if plan is None or rows is not None or short not in ROW_PARALLEL:
        return rows, None
    return None, column_run(plan, short, shape[1])


def _bias(bias: Any, rows: list[slice] | None, short: str, plan: ShardPlan | None) -> torch.Tensor | None:
    """The rank's part of a linear's bias: its rows' (column-parallel), whole on rank 0 alone (row-parallel: the
    ranks' partial products are summed), or whole (`plan` None: a linear every rank keeps whole)."""
    if bias is None or (plan is not None and short in ROW_PARALLEL and rows is None and plan.rank != 0):
        return None
    return keep_runs(bias, rows) if rows is not None else torch.as_tensor(bias[...])


def cut_codes(parts: Int4Parts, rows: list[slice] | None, columns: slice | None) -> Int4Parts:
    """`parts`' rows of `rows` (all their groups), or its input `columns`: of consecutive groups, by the finer
    groups that are whole in them (`whole_groups`), else (act-order, or finer groups too small) with the groups they
    use renumbered in order; or all of it."""
    if rows is not None:
        keep = torch.cat([torch.arange(run.start, run.stop) for run in rows])
        codes, scale, zero = (t[keep].contiguous() for t in (parts.codes, parts.scale, parts.zero))
        return dataclasses.replace(parts, codes=codes, scale=scale, zero=zero)
    if columns is None:
        return parts
    size, count = parts.group_size(), columns.stop - columns.start
    least = LEAST_GROUP if parts.bits == 8 else GROUP_TILE  # (finer 4-bit groups: no kernel's)
    fine = whole_groups(size, columns.start, count, least=least) if size else 0
    if fine:  # consecutive groups, cut into finer ones at the rank's edges: the format's layout kept
        groups = torch.arange(columns.start // fine, columns.stop // fine) * fine // cast(int, size)  # (stored ones)
        g_idx = torch.arange(count, dtype=parts.g_idx.dtype) // fine
    else:
        groups, g_idx = torch.unique(parts.g_idx[columns], sorted=True, return_inverse=True)
    return dataclasses.replace(
        parts,
        codes=parts.codes[:, columns].contiguous(),
        scale=parts.scale[:, groups].contiguous(),
        zero=parts.zero[:, groups].contiguous(),
        g_idx=g_idx,
    )


def maxima_over_ranks(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """For a rank's shard of `model` (cut by `shard_model`): a tensor's elementwise maxima over the ranks (the
    ranks' own, all-reduced over their group, in place)."""
    import torch.distributed as dist

    shard = shard_of(model)
    if shard is None:
        raise ValueError("a model cut by shard_model has ranks to reduce over")
    group = shard.group

    def maxima(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x

    return maxima


def quantize_fp8_shard(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """``quantize=fp8`` on a rank's float shard (cut by `shard_model`): every linear but the output projection (of a
    VLM: of its decoder, `text_part`) quantized to fp8 per output channel (`quantize_fp8`) and made by `fp8_module`,
    a row-parallel linear's scale of a row that of the whole row (the ranks' maxima all-reduced), as one process
    quantizes it; per tensor where
    `per_tensor_at_load` says, every linear's one scale that of the whole weight (the ranks' maxima all-reduced).
    How many."""
    maxima = maxima_over_ranks(model)
    shard = cast(Any, shard_of(model))
    row_parallel = {id(m) for name, m in model.named_modules() if name.rpartition(".")[2] in ROW_PARALLEL}
    keep = weights_kept_for(model, device, f"rank {shard.plan.rank}: quantize=fp8", "fp8")
    per_tensor = per_tensor_at_load(device)

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        amax = None
        if per_tensor or id(linear) in row_parallel:
            w = linear.weight.detach().float().abs()
            amax = maxima(w.amax().reshape(1) if per_tensor else w.amax(dim=1))
        weight, scale = quantize_fp8(linear.weight, amax, per_tensor)
        return fp8_module(weight, scale, linear.bias, dtype, device, keep)

    return replace_linears(text_part(model), lambda linear: True, make)
