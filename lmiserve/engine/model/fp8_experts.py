"""A mixture of experts' fp8 experts kept fp8 on a GPU (issue #39): the fp8 releases of Qwen3-MoE (Qwen's block-wise
Qwen3-30B-A3B-FP8, RedHatAI's compressed-tensors), Mixtral and the Qwen2-MoEs store each expert's matrices in fp8.

Why: until this module the loader de-quantized them to the compute dtype (transformers' grouped products take
floats), which doubles the experts' memory, most of such a model's: Qwen3-30B-A3B-FP8 (31 GB) took 61 GB, more
than an A100 40GB or an L40S has, and Mixtral-8x7B's fp8 (47 GB) 94 GB, more than one H100. So where de-quantized
the model would take more than `weight_fit.FIT_SHARE` of the GPU's free memory, or where
``LMISERVE_USE_TRITON_FP8=1`` forces it (``0``: always de-quantized), the experts stay fp8 (`kept_for`, logged).

Kept experts run this module's grouped product (`fp8_experts_kernel`): the rows sorted by expert are cut into tiles
of one expert each (`grouped_experts.row_tiles`, on the device: no host sync, so the decode graphs capture it in any
dtype), and each tile reads its expert's fp8 weight once, widened in registers (an A100's bytes too:
`fp8_devices.native`), scaled per output channel or by blocks of inputs (block-wise fp8's 128). `keep` turns an
experts module of transformers (`grouped_experts.servable`: Mixtral's, the Qwen MoEs', OLMoE's, GLM-4.5's) into one
whose forward is `grouped_experts.forward`: transformers' grouped forward with this product. On a CPU (computing in
fp32 or bf16) the experts are kept on the CPU's q8 kernel instead (`cpu_experts`; the tests set `INTERPRETED_ON_CPU`
to keep them as a GPU does and run this kernel under Triton's interpreter); elsewhere on a CPU each expert's weight is
de-quantized for its rows (`dequantized_product`).

Not measured yet: the kernel's speed (a GPU's). Its tiles are fixed (`tile_of`), not timed at start as
`fp8_gemv`'s are."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import cpu_experts, fp8_gemv, grouped_experts, weight_fit
from lmiserve.engine.model.expert_matrices import Read, WholeBlocks, stacked_experts
from lmiserve.engine.model.fp8_ops import quantize_fp8
from lmiserve.engine.model.language_model import text_part
from lmiserve.engine.model.shard_quantized import Fp8Scaled

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

log = logging.getLogger(__name__)

__all__ = [
    "INTERPRETED_ON_CPU",
    "dequantized_product",
    "grouped_product",
    "keep",
    "keep_stored",
    "kept_for",
    "quantize",
    "quantize_servable",
    "stacked_fp8",
    "tile_of",
]

INTERPRETED_ON_CPU = False


def kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool:
    """Whether the fp8 experts of `model` (on the meta device in the compute dtype) stay fp8 on `device`: on a GPU
    where Triton runs (compute capability 8.0 or more) as `weight_fit.kept_for` says (``LMISERVE_USE_TRITON_FP8``
    forces it either way), on a CPU as `cpu_experts.kept_for` says (fp32 or bf16), logged for the checkpoint
    `name`; never elsewhere."""
    if device.type == "cpu":
        return cpu_experts.kept_for(model, device, name, "fp8")
    if not weight_fit.triton_gpu(device):
        return False
    return weight_fit.kept_for(
        log, model, device, name, fp8_gemv.USE_ON_CUDA, "LMISERVE_USE_TRITON_FP8", "fp8 experts on the Triton kernel"
    )


def keep(
    experts: torch.nn.Module,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    down_pad: tuple[int, int] = (0, 0),
) -> bool:
    """Make `experts` (`grouped_experts.servable`) run on fp8 `weights`: for ``gate_up_proj`` and ``down_proj``
    each, the fp8 weight ``[experts, out, in]`` and its fp32 scales ``[experts, out]`` (a channel's) or ``[experts,
    out, blocks]`` (each row's by blocks of inputs, a power of two: `fp8_gemv.input_block`). `down_pad`:
    `grouped_experts.keep`'s (a rank's inputs of down_proj widened to whole blocks). On a CPU (`weights` there, not
    under the interpreter) the CPU's q8 kernel's (`cpu_experts.keep_q8`). Whether they are kept (False: that kernel
    does not take their shapes; nothing changed)."""
    if next(iter(weights.values()))[0].device.type == "cpu" and not INTERPRETED_ON_CPU:
        return cpu_experts.keep_q8(experts, weights, down_pad)
    tensors = {}
    for kind, (weight, scales) in weights.items():
        tensors[kind], tensors[f"{kind}_scales"] = weight, scales.float()
    grouped_experts.keep(experts, tensors, _product, "fp8", down_pad)
    return True


def _product(x: torch.Tensor, experts: torch.nn.Module, kind: str, counts: torch.Tensor) -> torch.Tensor:
    weight, scales = cast(torch.Tensor, getattr(experts, kind)), cast(torch.Tensor, getattr(experts, f"{kind}_scales"))
    return grouped_product(x, weight, scales, counts)


def stacked_fp8(
    owner: str,
    count: int,
    names: Any,
    read: Read,
    blocks: tuple[int, int] | None,
    part: Callable[[int], slice] = lambda size: slice(0, size),
    inputs: Callable[[int], slice] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """The fp8 weights and scales `keep` takes for the experts module `owner` of `count` experts, stacked from the
    checkpoint's matrices of each expert (`names`: the checkpoint's tensors; `read`: one's slice; `blocks`: the
    checkpoint's block of rows and inputs, None: a scale a channel or a tensor), each cut to `part` of its
    intermediate size (a tensor-parallel rank's, `ShardPlan.part`; else all of it; down_proj's inputs to `inputs`
    where given: `WholeBlocks`); None where they are not all fp8 with scales this kernel reads (blocks of inputs a
    power of two, 16 or more; a rank's inputs of down_proj starting a block: `WholeBlocks`): they are de-quantized
    instead."""
    found = {}
    for kind in ("gate_up_proj", "down_proj"):
        weight = stacked_experts(owner, kind, count, names, read, part, inputs)
        if weight is None or weight.dtype != torch.float8_e4m3fn:
            return None
        try:
            scales = stacked_experts(
                owner, kind, count, names, lambda name: _RowScales(name, names, read, blocks), part, inputs
            )
        except LookupError:
            return None
        group = fp8_gemv.input_block(weight.shape[2], scales[0])
        if 0 < group < 16 or (group and scales.shape[2] != -(-weight.shape[2] // group)):
            return None
        found[kind] = (weight, scales)
    return found


class _RowScales:
    """The scales of an expert's fp8 matrix `name` as `keep` takes them, read as `stacked_experts` reads a matrix
    whole: ``[out]`` (a scale a channel, or the tensor's for each row) or ``[out, blocks]`` (`fp8_gemv.block_scales`);
    LookupError where it has none, or blocks this kernel does not read."""

    def __init__(self, name: str, names: Any, read: Read, blocks: tuple[int, int] | None) -> None:
        base = name.removesuffix(".weight")
        stored = next((f"{base}.{s}" for s in ("weight_scale_inv", "weight_scale") if f"{base}.{s}" in names), None)
        if stored is None:
            raise LookupError(f"{name} has no scale")
        scaled = Fp8Scaled(read(name), read(stored), blocks)
        self.shape = scaled.shape
        (out, inputs), grid = scaled.shape, scaled.scale
        rows = None if blocks is None else fp8_gemv.block_scales(grid, out, inputs, scaled.block)
        if blocks is not None and rows is None:
            raise LookupError(f"{name}'s blocks of inputs are not a power of two")
        self.scales = grid.repeat_interleave(scaled.block[0], 0)[:out, 0] if rows is None else rows
        self.inputs_a_block = scaled.block[1] if self.scales.dim() == 2 else 0  # (0: one scale over a row)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The scales of a run of rows (``[rows]``), or of every row over a run of inputs (``[:, inputs]``: a
        tensor-parallel rank's of down_proj), which must start a block."""
        rows, inputs = index if isinstance(index, tuple) else (index, slice(None))
        first, end, _ = inputs.indices(self.shape[1])
        if not self.inputs_a_block:
            return self.scales[rows]
        if first % self.inputs_a_block:
            raise LookupError(f"inputs from {first} do not start a block of {self.inputs_a_block}")
        return self.scales[rows, first // self.inputs_a_block : -(-end // self.inputs_a_block)]


def quantize(experts: torch.nn.Module, reduced: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """`keep` `experts`' float weights (``quantize=fp8`` on a float checkpoint, vLLM's online fp8), each quantized to
    fp8 with a scale an output channel (`fp8_ops.quantize_fp8`), an expert at a time (no fp32 copy of them all).
    `reduced`, where `experts` are a tensor-parallel rank's part (down_proj's inputs cut): each down_proj row's
    ``max|w|`` over the ranks from the rank's own (fp32 ``[experts, out]``), so that a rank's scales are its whole
    rows', as one process's. Whether they are kept (`keep`'s: else they stay float)."""
    weights = {}
    for kind in ("gate_up_proj", "down_proj"):
        stacked = getattr(experts, kind).detach()
        amax = None
        if reduced is not None and kind == "down_proj":
            amax = reduced(torch.stack([matrix.abs().amax(dim=1).float() for matrix in stacked]))
        made = [quantize_fp8(matrix, None if amax is None else amax[e]) for e, matrix in enumerate(stacked)]
        weights[kind] = (torch.stack([q for q, _ in made]), torch.stack([s for _, s in made]))
    return keep(experts, weights)


def quantize_servable(
    model: torch.nn.Module,
    device: torch.device,
    name: str,
    reduced: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """``quantize=fp8``'s experts: every servable experts module of `model` (of a VLM: of its decoder; a whole
    model, or a tensor-parallel rank's shard, `reduced` as `quantize`'s) kept fp8 per output channel where `kept_for`
    says so for `device` (`name`: the checkpoint's or the rank's, for the log), else left float; how many. Over
    ranks they are kept only where every rank's `kept_for` says so (a rank's GPU may have less free), so that the
    ranks reduce their maxima together."""
    found = grouped_experts.servable_modules(text_part(model)).values()
    if not found:
        return 0
    keep_here = kept_for(model, device, name)
    if reduced is not None:  # (a rank that would not keep them says so to all: the maximum of "not kept")
        keep_here = not reduced(torch.tensor([float(not keep_here)], device=device)).item()
    if not keep_here:
        return 0
    return sum(quantize(experts, reduced) for experts in found)


def keep_stored(
    model: torch.nn.Module,
    names: Any,
    read: Read,
    blocks: tuple[int, int] | None,
    device: torch.device,
    name: str,
    part: Callable[[int], slice] = lambda size: slice(0, size),
) -> set[str]:
    """An fp8 checkpoint's experts kept fp8 where `kept_for` says so for `model` (the meta model, or a
    tensor-parallel rank's shell; `name`: the checkpoint's or the rank's, for the log): each servable experts module
    read from the checkpoint (`names`, `read`: the raw tensors; `part` of every expert's intermediate size: a rank's,
    `ShardPlan.part`, down_proj's inputs widened to whole blocks: `WholeBlocks`) by `stacked_fp8` and `keep`-ed on
    `device`; their names (the others are left to be de-quantized)."""
    found = grouped_experts.servable_modules(model)
    if not found or not kept_for(model, device, name):
        return set()
    made = set()
    for owner, module in found.items():
        count = int(cast(torch.Tensor, module.down_proj).shape[0])
        down = WholeBlocks(part, blocks[1] if blocks else 0)
        weights = stacked_fp8(owner, count, names, read, blocks, part, down)
        if weights is None:
            continue
        if keep(module, {kind: (w.to(device), s.to(device)) for kind, (w, s) in weights.items()}, down.pad):
            made.add(owner)
    return made


def grouped_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x[r] @ (weight[e] * scales[e]).T`` in `x`'s dtype (`weight` fp8, or int8 codes: `int8_experts`) for the rows
    of `x` ``[S, K]``, sorted by expert, the first ``counts[0]`` routed to expert 0, the next ``counts[1]`` to expert
    1, ...: on the Triton kernel on a GPU (and on a CPU under the interpreter: `INTERPRETED_ON_CPU`), else
    `dequantized_product`."""
    if triton is None or not (x.is_cuda or INTERPRETED_ON_CPU):
        return dequantized_product(x, weight, scales, counts)
    x = x.contiguous()
    group = fp8_gemv.input_block(x.shape[1], scales[0])
    tile = tile_of(x.shape[0], weight.shape[0], group)
    strides = (weight.stride(0), scales.stride(0), scales.stride(1) if scales.dim() == 3 else 1)
    return grouped_experts.launch(
        _kernel(), x, (weight.view(torch.uint8), scales), weight.shape[1], tile, counts, strides,
        EVEN_K=x.shape[1] % tile[2] == 0, NATIVE=fp8_devices.native(x.device), INT8=weight.dtype == torch.int8,
        GROUP=group,
    )  # fmt: skip


def tile_of(rows: int, experts: int, group: int) -> tuple[int, int, int, int]:
    """The kernel's tile (rows, outputs, inputs, warps) for `rows` routed rows over `experts` experts: 16 rows (the
    tensor cores' least) where an expert gets few rows (decode), 64 where they average 64 or more (prompts); 128
    inputs a step, fewer where blocks of inputs are smaller (a tile's inputs lie in one block)."""
    block_m = grouped_experts.tile_rows(rows, experts)
    block_k = min(128, group) if group else 128
    return block_m, 64, max(block_k, 16), 4


def dequantized_product(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`grouped_product` by torch (a CPU's): `grouped_experts.dequantized_product` of the fp8 weights."""
    return grouped_experts.dequantized_product(
        x, weight.shape[1], counts, lambda e: fp8_gemv.dequantized_weight(weight[e], scales[e])
    )


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.fp8_experts_kernel import fp8_experts_kernel

    return triton.jit(fp8_experts_kernel)
