"""A mixture of experts' 4-bit experts kept 4-bit on a GPU (issue #39): AutoAWQ's and GPTQModel's releases of
Qwen3-MoE, Mixtral and the Qwen2-MoEs (Qwen3-30B-A3B-GPTQ-Int4, Mixtral-8x7B-Instruct AWQ), and llm-compressor's
W4A16, store each expert's matrices as 4-bit codes with a scale and a zero a group of inputs.

Why: the loader de-quantized them to the compute dtype (transformers' grouped products take floats), four times their
bytes, and the experts are most of such a model: Qwen3-30B-A3B's 4-bit release (17 GB) took 61 GB, Mixtral-8x7B's
(24 GB) 94 GB, more than one H100. So where de-quantized the model would take more than `weight_fit.FIT_SHARE` of
the GPU's free memory, or where ``LMISERVE_USE_TRITON_INT4=1`` forces it (``0``: always de-quantized), the experts
keep their codes (`kept_for`: the rule of the 4-bit linears, `int4_triton.codes_kept_for`), and run this module's
grouped product (`int4_experts_kernel`): the rows sorted by expert, cut into tiles of one expert each on the device
(`grouped_experts.row_tiles`: the decode graphs capture it in any dtype), each tile reading its expert's codes once.

Served: groups of a multiple of 32 inputs (AWQ's and GPTQ's 128, 64 or 32; W4A16's, or one group a row), 4-bit
codes; GPTQ's act-order too (each expert's inputs stored sorted by group, the kernel reading the rows' columns in that
order). 8-bit codes are `int8_experts`'; a tensor-parallel rank whose inputs of down_proj are not whole groups keeps
the groups that cover them (`expert_matrices.WholeBlocks`), a part of an act-order matrix's is de-quantized instead.
Layout (`keep`):
``{kind}`` int32 ``[experts, out, in / 8]`` (nibble j of word r: input 8r + j, `int4_triton.pack_nibbles`),
``{kind}_scales`` and ``{kind}_zeros`` fp32 ``[experts, groups, out]`` (zeros in steps). On a CPU (fp32 or bf16)
the codes are kept on the CPU's int4 kernel instead (`cpu_experts`; the tests set `INTERPRETED_ON_CPU` to keep them as
a GPU does and run this kernel under Triton's interpreter); elsewhere on a CPU each expert's weight is de-quantized
for its rows (`dequantized_product`).

Not measured yet: the kernel's speed (a GPU's). Its tiles are fixed (`tile_of`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from lmiserve.engine.model import cpu_experts, expert_codes, grouped_experts, int4_triton
from lmiserve.engine.model.quant_formats import unpack_words

if TYPE_CHECKING:
    from lmiserve.engine.model.quant_formats import Int4Parts, QuantSpec

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

__all__ = [
    "INTERPRETED_ON_CPU",
    "dequantized_product",
    "grouped_product",
    "keep",
    "kept_for",
    "stacked",
    "takes",
    "tile_of",
]

INTERPRETED_ON_CPU = False
KEPT = "4-bit"  # (`expert_codes.Format`)
PARTS = ("", "_scales", "_zeros", "_order")  # a kind's attributes (``gate_up_proj``, ``down_proj``) `keep` sets


def kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool:
    """Whether the 4-bit experts of `model` (on the meta device in the compute dtype: a whole model's, or a
    tensor-parallel rank's shell) keep their codes on `device`: as the 4-bit linears do (`int4_triton.codes_kept_for`,
    logged for `name`), on a GPU where Triton runs; on a CPU as `cpu_experts.kept_for` says (fp32 or bf16: the
    CPU's q4 kernel)."""
    if device.type == "cpu":
        return cpu_experts.kept_for(model, device, name, "4-bit")
    return bool(int4_triton.codes_kept_for(model, device, name))


def keep(
    experts: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, ...]], down_pad: tuple[int, int] = (0, 0)
) -> bool:
    """Make `experts` (`grouped_experts.servable`) run on 4-bit `weights`: for ``gate_up_proj`` and ``down_proj``
    each, the codes as int32 words ``[experts, out, in / 8]``, fp32 scales and zeros ``[experts, groups, out]``, and
    with GPTQ's act-order each expert's order of inputs ``[experts, in]`` (int32: stored input k is input
    ``order[e, k]``). `down_pad`: `grouped_experts.keep`'s (a rank's inputs of down_proj widened to whole groups). On
    a CPU (`weights` there, not under the interpreter) the CPU's q4 kernel's (`cpu_experts.keep_q4`). Whether they are
    kept (False: that kernel does not take their shapes; nothing changed)."""
    if next(iter(weights.values()))[0].device.type == "cpu" and not INTERPRETED_ON_CPU:
        return cpu_experts.keep_q4(experts, weights, down_pad)
    tensors = {}
    for kind, parts in weights.items():
        tensors.update({f"{kind}{suffix}": part for suffix, part in zip(PARTS, parts, strict=False)})
    grouped_experts.keep(experts, tensors, _product, "int4", down_pad)
    return True


def _product(x: torch.Tensor, experts: torch.nn.Module, kind: str, counts: torch.Tensor) -> torch.Tensor:
    words, scales, zeros = (cast(torch.Tensor, getattr(experts, f"{kind}{suffix}")) for suffix in PARTS[:3])
    return grouped_product(x, words, scales, zeros, counts, getattr(experts, f"{kind}_order", None))


class _Codes:
    """An expert's 4-bit matrix (its codes, scales and zeros unpacked: `parts`) read as `stacked_experts` reads a
    matrix: ``[out, in]`` by its shape, a run of rows (``[rows]``) or of inputs (``[:, inputs]``: a tensor-parallel
    rank's of down_proj, which must start a group and end one or the row), as one int32 row an output: its words
    (``inputs / 8``), then its groups' scales and zeros (fp32's bits), so the matrix is read once. GPTQ's act-order
    (groups not runs of inputs): the codes' inputs stored sorted by group (`int4_triton.group_layout`), whole rows
    only. `seen` records the words and groups of the last read and each read's order of inputs (None: as stored).
    LookupError where the matrix is one this kernel does not read."""

    def __init__(self, parts: Int4Parts, seen: dict[str, Any]) -> None:
        self.parts, self.seen = parts, seen
        self.order, group = int4_triton.group_layout(parts.g_idx, parts.scale.shape[1])
        inputs = parts.codes.shape[1]
        if parts.bits != 4 or group is None or group % int4_triton.GROUP_TILE or inputs % group:
            raise LookupError("4-bit codes in groups of a multiple of 32 inputs are kept")
        self.group = group

    def get_shape(self) -> tuple[int, ...]:
        return tuple(self.parts.codes.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, first, end = expert_codes.cut(index, self.parts.codes.shape[1], self.group)
        if self.order is not None and end - first != self.parts.codes.shape[1]:
            raise LookupError("a part of an act-order matrix's inputs is not whole groups")
        codes = self.parts.codes[rows, first:end] if self.order is None else self.parts.codes[rows][:, self.order]
        groups = slice(first // self.group, -(-end // self.group))
        self.seen.update(words=(end - first) // 8, groups=groups.stop - groups.start)
        self.seen.setdefault("orders", []).append(self.order)
        scales, zeros = (held[rows, groups].float().view(torch.int32) for held in (self.parts.scale, self.parts.zero))
        return torch.cat([int4_triton.pack_nibbles(codes.reshape(codes.shape[0], -1, 8)), scales, zeros], dim=1)


def stacked(
    owner: str,
    count: int,
    names: Any,
    parts_of: Callable[[str], Int4Parts],
    part: Callable[[int], slice] = lambda size: slice(0, size),
    inputs: Callable[[int], slice] | None = None,
) -> dict[str, tuple[torch.Tensor, ...]] | None:
    """The words, scales and zeros (and with GPTQ's act-order each expert's order of inputs) `keep` takes for the
    experts module `owner` of `count` experts, stacked from the checkpoint's 4-bit matrices of each expert (`names`:
    the checkpoint's tensors; `parts_of`: a linear's codes, scales and zeros unpacked, `shard_quantized.int4_parts`),
    each cut to `part` of its intermediate size (a tensor-parallel rank's, `ShardPlan.part`; else all of it;
    down_proj's inputs to `inputs` where given); None where they are not all 4-bit codes this kernel reads (or an
    expert's gate and up take their inputs in two orders): they are de-quantized instead."""
    found: dict[str, tuple[torch.Tensor, ...]] = {}
    for kind in ("gate_up_proj", "down_proj"):
        stacked = expert_codes.stacked_rows(owner, kind, count, names, parts_of, part, _Codes, inputs)
        if stacked is None:
            return None
        rows, seen = stacked
        words, groups = seen["words"], seen["groups"]
        scales, zeros = (rows[..., at : at + groups].view(torch.float32) for at in (words, words + groups))
        found[kind] = (
            rows[..., :words].contiguous(),
            scales.transpose(1, 2).contiguous(),
            zeros.transpose(1, 2).contiguous(),
        )
        orders = seen["orders"]  # (gate's of each expert, then up's: `stacked_experts`' order of reading)
        if any(order is not None for order in orders):
            stored = torch.arange(words * 8)
            each = [stored if order is None else order for order in orders]
            if any(not torch.equal(a, b) for a, b in zip(each[:count], each[count:], strict=False)):
                return None  # (gate and up of an expert in two orders: one order a row of outputs is not kept)
            found[kind] = (*found[kind], torch.stack(each[:count]).int())
    return found


def takes(quant: QuantSpec) -> bool:
    """Whether a checkpoint's codes (`quant`) are AWQ's or GPTQ's 4-bit ones (compressed-tensors' W4A16 is read as
    GPTQ's): `expert_codes.keep_stored` keeps them where the linears keep theirs (or
    `kept_for` says so)."""
    return quant.method in ("awq", "gptq") and quant.bits == 4


def grouped_product(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    counts: torch.Tensor,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x[r] @ W[e].T`` in `x`'s dtype for the rows of `x` ``[S, K]``, sorted by expert (the first ``counts[0]``
    routed to expert 0, ...), ``W[e]`` expert e's codes `words` ``[E, N, K / 8]`` less its `zeros`, times its
    `scales` (``[E, groups, N]``), its stored inputs `order` ``[E, K]`` of x's columns (GPTQ's act-order; None: in
    order): on the Triton kernel on a GPU (and on a CPU under the interpreter: `INTERPRETED_ON_CPU`), else
    `dequantized_product`."""
    if triton is None or not (x.is_cuda or INTERPRETED_ON_CPU):
        return dequantized_product(x, words, scales, zeros, counts, order)
    x = x.contiguous()
    group = x.shape[1] // scales.shape[1]
    tile = tile_of(x.shape[0], words.shape[0], group, order is not None)
    weights = (words, scales, zeros, words if order is None else order)
    return grouped_experts.launch(
        _kernel(), x, weights, words.shape[1], tile, counts, (words.stride(0), scales.stride(0)),
        GROUP=group, HAS_ORDER=order is not None,
    )  # fmt: skip


def tile_of(rows: int, experts: int, group: int, ordered: bool = False) -> tuple[int, int, int, int]:
    """The kernel's tile (rows, outputs, inputs, warps) for `rows` routed rows over `experts` experts
    (`grouped_experts.tile_rows`): 128 inputs a step, or 64 or 32, the most that divides a group (a tile's inputs lie
    in one group); at most 64 for a prompt's tiles of act-order rows (their gathered columns would spill registers at
    128: `test_kernels_compile_for_cuda`)."""
    block_m = grouped_experts.tile_rows(rows, experts)
    block_k = next(k for k in (128, 64, 32) if group % k == 0)
    if ordered and block_m > 16:
        block_k = min(block_k, 64)
    return block_m, 64, block_k, 4


def dequantized_product(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    counts: torch.Tensor,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """`grouped_product` by torch (a CPU's): `grouped_experts.dequantized_product` of the 4-bit codes."""

    def weight_of(e: int) -> torch.Tensor:
        return dequantized_weight(words[e], scales[e], zeros[e], None if order is None else order[e])

    return grouped_experts.dequantized_product(x, words.shape[1], counts, weight_of)


def dequantized_weight(
    words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, order: torch.Tensor | None = None
) -> torch.Tensor:
    """An expert's weight ``[out, in]`` in fp32 from its words ``[out, in / 8]``, its scales and zeros ``[groups,
    out]``, and the input each stored one is (`order`; None: in order)."""
    codes = unpack_words(words).reshape(words.shape[0], -1).float()
    group = codes.shape[1] // scales.shape[0]
    stored = (codes - zeros.t().repeat_interleave(group, 1)) * scales.t().repeat_interleave(group, 1)
    if order is None:
        return stored
    return torch.empty_like(stored).index_copy_(1, order.long(), stored)


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.int4_experts_kernel import int4_experts_kernel

    return triton.jit(int4_experts_kernel)
