"""A mixture of experts' 8-bit experts kept as codes on a GPU (issue #39): GPTQ's Int8 releases of the Qwen MoEs
(Qwen3-30B-A3B-GPTQ-Int8, Qwen2-57B-A14B-Instruct-GPTQ-Int8, Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int8) and compressed-tensors'
W8A16 and W8A8 store each expert's matrices as 8-bit integer codes with a scale a group of inputs or a channel.

Why: the loader de-quantized them to the compute dtype, twice their bytes, and the experts are most of such a model:
Qwen3-30B-A3B's Int8 release (31 GB) took 61 GB, more than an A100 40GB or an L40S has. So where de-quantized the
model would take more than `weight_fit.FIT_SHARE` of the GPU's free memory, or where ``LMISERVE_USE_TRITON_INT8=1``
forces it (``0``: always de-quantized), the experts keep their codes (`kept_for`: the rule of the 8-bit linears,
`int8_weights.weights_kept_for`) and run `fp8_experts`' grouped kernel, which reads int8 codes as it reads fp8 bytes
(``INT8``: each code exact in the activations' dtype), with its scales a channel or a block of inputs.

Served: symmetric codes (zero 128, GPTQ's ``sym=True``) whose groups are runs of a power of two inputs, or one scale a
row (`int8_weights.served_scales`, the 8-bit linears' rule). Others (asymmetric codes, GPTQ's act-order) are
de-quantized; a tensor-parallel rank whose inputs of down_proj are not whole groups keeps the groups that cover them
(`expert_matrices.WholeBlocks`). Layout (`fp8_experts.keep`):
``{kind}`` int8 ``[experts, out, in]`` (the signed codes), ``{kind}_scales`` fp32 ``[experts, out]`` or ``[experts,
out, groups]``. W8A8's int8 activations are not taken: the kept experts multiply the activations in the compute
dtype (weight-only, as the 8-bit linears' kernel does).

On a CPU (fp32 or bf16) the codes are kept on the CPU's q8 kernel (`cpu_experts`, through `fp8_experts.keep`).

Not measured yet: the kernel's speed on int8 codes (a GPU's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from lmiserve.engine.model import cpu_experts, expert_codes, fp8_experts, int8_weights

if TYPE_CHECKING:
    from lmiserve.engine.model.quant_formats import Int4Parts, QuantSpec

__all__ = ["KEPT", "keep", "kept_for", "stacked", "takes"]

KEPT = "int8"  # (`expert_codes.Format`)


def kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool:
    """Whether the 8-bit experts of `model` (on the meta device in the compute dtype: a whole model's, or a rank's
    shell) keep their codes on `device`: the 8-bit linears' rule (`int8_weights.weights_kept_for`), logged for
    `name`; on a CPU, as `cpu_experts.kept_for` says (fp32 or bf16: the CPU's q8 kernel)."""
    if device.type == "cpu":
        return cpu_experts.kept_for(model, device, name, "8-bit")
    return bool(int8_weights.weights_kept_for(model, device, name))


class _Codes:
    """An expert's 8-bit matrix (its codes, scales and zeros unpacked: `parts`) read as `stacked_experts` reads a
    matrix: ``[out, in]`` by its shape, a run of rows (``[rows]``) or of inputs (``[:, inputs]``: a tensor-parallel
    rank's of down_proj, which must start a group and end one or the row), as one byte row an output: its signed
    codes, then its scales (fp32's bytes), so the matrix is read once. `seen` records the inputs and the scales of
    the last read. LookupError where the matrix is one the kernel does not read."""

    def __init__(self, parts: Int4Parts, seen: dict[str, Any]) -> None:
        group = parts.group_size()
        scales = None if parts.bits != 8 else int8_weights.served_scales(parts.codes, parts.scale, parts.zero, group)
        if scales is None:
            raise LookupError("symmetric 8-bit codes in runs of a power of two inputs, or a scale a row, are kept")
        self.parts, self.seen = parts, seen
        self.group = 0 if scales.dim() == 1 else cast(int, group)  # (0: one scale a row)
        self.scales = scales.reshape(scales.shape[0], -1)

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.parts.codes.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, first, end = expert_codes.cut(index, self.parts.codes.shape[1], self.group)
        scales = self.scales[rows]
        if self.group:
            scales = scales[:, first // self.group : -(-end // self.group)]
        self.seen.update(inputs=end - first, per_channel=not self.group)
        codes = int8_weights.signed_codes(self.parts.codes[rows, first:end]).view(torch.uint8)
        return torch.cat([codes, scales.contiguous().view(torch.uint8)], dim=1)


def stacked(
    owner: str,
    count: int,
    names: Any,
    parts_of: Callable[[str], Int4Parts],
    part: Callable[[int], slice] = lambda size: slice(0, size),
    inputs: Callable[[int], slice] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """The signed codes and scales `fp8_experts.keep` takes for the experts module `owner` of `count` experts,
    stacked from the checkpoint's 8-bit matrices of each expert (`names`: the checkpoint's tensors; `parts_of`: a
    linear's codes, scales and zeros unpacked, `shard_quantized.int4_parts`), each cut to `part` of its intermediate
    size (a tensor-parallel rank's, `ShardPlan.part`; else all of it; down_proj's inputs to `inputs` where given);
    None where they are not all 8-bit codes the kernel reads: they are de-quantized instead."""
    found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind in ("gate_up_proj", "down_proj"):
        stacked = expert_codes.stacked_rows(owner, kind, count, names, parts_of, part, _Codes, inputs)
        if stacked is None:
            return None
        rows, seen = stacked
        width = seen["inputs"]
        scales = rows[..., width:].contiguous().view(torch.float32)
        codes = rows[..., :width].contiguous().view(torch.int8)
        found[kind] = (codes, scales[..., 0] if seen["per_channel"] else scales)
    return found


def takes(quant: QuantSpec) -> bool:
    """Whether a checkpoint's codes (`quant`) are 8-bit integers (GPTQ's 8 bits, compressed-tensors' int8):
    `expert_codes.keep_stored` keeps them where the linears keep theirs (or
    `kept_for` says so)."""
    return quant.bits == 8


def keep(
    experts: torch.nn.Module,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    down_pad: tuple[int, int] = (0, 0),
) -> bool:
    """Make `experts` run on 8-bit `weights` (`stacked`'s codes and scales) on `fp8_experts`' kernel (on a CPU: the
    q8 kernel, `cpu_experts`); whether they are kept (`down_pad`: `grouped_experts.keep`'s)."""
    return fp8_experts.keep(experts, weights, down_pad)
