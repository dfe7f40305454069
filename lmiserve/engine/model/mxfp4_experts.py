"""gpt-oss's MXFP4 experts kept MXFP4 on a GPU and on a CPU (issue #39): OpenAI publishes gpt-oss-20b
and gpt-oss-120b with their experts' weights as 4-bit floats (e2m1, two a byte) and a power of two a block of 32
inputs (``*_blocks``, ``*_scales``).

Why: the loader had transformers de-quantize them to the compute dtype, about 4x their bytes: gpt-oss-120b (63 GB on
disk) took 234 GB, more than two H100s, where vLLM serves it on one; gpt-oss-20b (13 GB) took 42 GB. So where the model
de-quantized would take more than `weight_fit.FIT_SHARE` of the GPU's free memory, or where
``LMISERVE_USE_TRITON_MXFP4=1`` forces it (``0``: always de-quantized), the experts stay MXFP4 (`kept_for`, logged) and
run this module's grouped product (`mxfp4_experts_kernel`): the rows sorted by expert, tiles of one expert found on the
device (`grouped_experts.row_tiles`: the decode graphs capture it in any dtype), each tile reading its expert's bytes
once and making their values in registers. gpt-oss's experts (`servable`: biases, gate and up interleaved, its clamped
SwiGLU) keep their biases and activation; `grouped_experts.forward` adds each row's expert's bias.

Layout (`keep`): ``{kind}`` uint8 ``[experts, out, in / 2]`` (the checkpoint's ``_blocks`` with their last two axes
merged), ``{kind}_scales`` uint8 ``[experts, out, in / 32]``. On a CPU (computing in fp32 or bf16) they are kept on the
CPU's f4 kernel instead (`cpu_experts.keep_mxfp4`: the same codes, half a byte a weight, in the group kernels' blocked
layout, each block's power of two an fp32 scale; the tests set `INTERPRETED_ON_CPU` to keep them as a GPU does and run
this kernel under Triton's interpreter); elsewhere on a CPU each expert's weight is de-quantized for its rows
(`dequantized_product`).

Over tensor parallelism each rank keeps its part by the same rule. Where its inputs of down_proj are not whole blocks
of 32 (gpt-oss's 2880 over four or eight ranks: 720 or 360 each), it keeps the whole blocks that cover them and pads
its activations with zeros (`expert_matrices.WholeBlocks`). Not measured yet: the kernel's speed
(a GPU's); its tiles are fixed (`tile_of`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from lmiserve.engine.model import cpu_experts, grouped_experts, kernel_choice, weight_fit
from lmiserve.engine.model.expert_matrices import Read, WholeBlocks

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

log = logging.getLogger(__name__)

__all__ = [
    "FP4",
    "INTERPRETED_ON_CPU",
    "USE_ON_CUDA",
    "dequantized_product",
    "dequantized_weight",
    "grouped_product",
    "keep",
    "keep_stored",
    "kept_for",
    "servable",
    "tile_of",
]

# True (LMISERVE_USE_TRITON_MXFP4=1): the experts MXFP4 on the kernel; False (=0): de-quantized at load; None (unset):
# MXFP4 where de-quantized they would not fit (`weight_fit.kept`)
USE_ON_CUDA = kernel_choice.switch("LMISERVE_USE_TRITON_MXFP4")
INTERPRETED_ON_CPU = False
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 by its code
KINDS = ("gate_up_proj", "down_proj")


def servable(experts: torch.nn.Module) -> bool:
    """Whether `experts` is gpt-oss's experts module (the layout MXFP4 checkpoints quantize): each expert's gate/up
    and down with a bias, gate and up interleaved, its activation `_apply_gate`."""
    return all(hasattr(experts, name) for name in ("_apply_gate", "gate_up_proj_bias", "down_proj_bias", "limit"))


def kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool:
    """Whether the MXFP4 experts of `model` (on the meta device in the compute dtype) stay MXFP4 on `device`: on a GPU
    where Triton runs (compute capability 8.0 or more) as `weight_fit.kept_for` says (``LMISERVE_USE_TRITON_MXFP4``
    forces it either way), on a CPU as `cpu_experts.kept_for` says (on its f4 kernel), logged for
    the checkpoint `name`; never elsewhere."""
    if device.type == "cpu":
        return cpu_experts.kept_for(model, device, name, "MXFP4")
    if not weight_fit.triton_gpu(device):
        return False
    switch = "LMISERVE_USE_TRITON_MXFP4"
    return weight_fit.kept_for(log, model, device, name, USE_ON_CUDA, switch, "MXFP4 experts on the Triton kernel")


def keep(
    experts: torch.nn.Module,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    down_pad: tuple[int, int] = (0, 0),
) -> None:
    """Make `experts` (`servable`) run on MXFP4 `weights`: for ``gate_up_proj`` and ``down_proj`` each, the bytes
    ``[experts, out, in / 2]`` and the blocks' powers ``[experts, out, in / 32]`` (uint8 both); the biases stay.
    `down_pad`: `grouped_experts.keep`'s (a rank's inputs of down_proj widened to whole blocks). On a CPU (`weights`
    there, not under the interpreter) on its f4 kernel (`cpu_experts.keep_mxfp4`) where it takes
    their shapes, else as MXFP4 bytes, each expert's weight de-quantized for its rows."""
    on_cpu = next(iter(weights.values()))[0].device.type == "cpu" and not INTERPRETED_ON_CPU
    if on_cpu and cpu_experts.keep_mxfp4(experts, weights, down_pad):
        return
    tensors = {}
    for kind, (blocks, scales) in weights.items():
        tensors[kind], tensors[f"{kind}_scales"] = blocks, scales
    grouped_experts.keep(experts, tensors, _product, "mxfp4", down_pad)


def _product(x: torch.Tensor, experts: torch.nn.Module, kind: str, counts: torch.Tensor) -> torch.Tensor:
    blocks, scales = cast(torch.Tensor, getattr(experts, kind)), cast(torch.Tensor, getattr(experts, f"{kind}_scales"))
    return grouped_product(x, blocks, scales, counts)


def keep_stored(
    model: torch.nn.Module,
    names: Any,
    read: Read,
    device: torch.device,
    part: Callable[[int], slice] = lambda size: slice(0, size),
) -> set[str]:
    """An MXFP4 checkpoint's experts kept MXFP4 on `device`: each servable experts module of `model` whose
    ``{kind}_blocks`` and ``{kind}_scales`` the checkpoint holds (`names`; `read`: a tensor's slice) `keep`-ed, cut to
    `part` of its intermediate size (a tensor-parallel rank's, `ShardPlan.part`: gate/up's outputs, gate and up
    interleaved, so one run of whole pairs; down's inputs, widened to whole blocks of 32 where they are not, the
    rank's activations padded with zeros to match: `WholeBlocks`); their names (the caller asked
    `kept_for`)."""
    made = set()
    for owner, module in model.named_modules():
        if not owner.endswith(".experts") or not servable(module):
            continue
        if not all(f"{owner}.{kind}_{piece}" in names for kind in KINDS for piece in ("blocks", "scales")):
            continue
        stored = {kind: (read(f"{owner}.{kind}_blocks"), read(f"{owner}.{kind}_scales")) for kind in KINDS}
        blocks, _ = stored["gate_up_proj"]  # [experts, 2 inter, hidden / 32, 16]
        rows = part(blocks.get_shape()[1])
        down = WholeBlocks(part, 32)
        inputs = down(stored["down_proj"][1].get_shape()[2] * 32)
        columns = slice(inputs.start // 32, inputs.stop // 32)
        weights = {}
        for kind, (blocks, scales) in stored.items():
            cut = (slice(None), rows) if kind == "gate_up_proj" else (slice(None), slice(None), columns)
            as_kept = (torch.as_tensor(blocks[cut]).flatten(2), torch.as_tensor(scales[cut]))  # ([E, out, in / 2])
            weights[kind] = (as_kept[0].contiguous().to(device), as_kept[1].contiguous().to(device))
        keep(module, weights, down.pad)
        made.add(owner)
    return made


def grouped_product(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[r] @ W[e].T`` in `x`'s dtype for the rows of `x` ``[S, K]``, sorted by expert (the first ``counts[0]``
    routed to expert 0, ...), ``W[e]`` expert e's MXFP4 `blocks` ``[E, N, K / 2]`` times its blocks' powers of two
    `scales` ``[E, N, K / 32]``: on the Triton kernel on a GPU (and on a CPU under the interpreter:
    `INTERPRETED_ON_CPU`), else `dequantized_product`."""
    if triton is None or not (x.is_cuda or INTERPRETED_ON_CPU):
        return dequantized_product(x, blocks, scales, counts)
    x = x.contiguous()
    tile = tile_of(x.shape[0], blocks.shape[0], x.shape[1])
    strides = (blocks.stride(0), scales.stride(0))
    return grouped_experts.launch(_kernel(), x, (blocks, scales), blocks.shape[1], tile, counts, strides)


def tile_of(rows: int, experts: int, inputs: int) -> tuple[int, int, int, int]:
    """The kernel's tile (rows, outputs, inputs, warps) for `rows` routed rows over `experts` experts
    (`grouped_experts.tile_rows`): 64 inputs a step where they divide the inputs (gpt-oss's 2880), else 32 (a block)."""
    return grouped_experts.tile_rows(rows, experts), 64, 64 if inputs % 64 == 0 else 32, 4


def dequantized_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An expert's weight ``[out, in]`` in fp32 from its bytes ``[out, in / 2]`` and powers ``[out, in / 32]``."""
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(1).long()  # [out, in]: low nibble first
    values = torch.tensor(FP4, device=blocks.device)[codes]
    powers = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=1)
    return values * powers


def dequantized_product(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`grouped_product` by torch (a CPU's): `grouped_experts.dequantized_product` of the MXFP4 bytes."""
    return grouped_experts.dequantized_product(
        x, blocks.shape[1], counts, lambda e: dequantized_weight(blocks[e], scales[e])
    )


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.mxfp4_experts_kernel import mxfp4_experts_kernel

    return triton.jit(mxfp4_experts_kernel)
