"""A mixture of experts' experts run on a grouped Triton kernel over their quantized weights (issue #39): what the
fp8 experts (`fp8_experts`) and the 4-bit AWQ/GPTQ experts (`int4_experts`) share.

An experts module of transformers (gated, ``[gate; up]`` concatenated, ``[experts, out, in]``, no bias: Mixtral's,
the Qwen MoEs', OLMoE's, GLM-4.5's: `servable`) is `keep`-ed on its quantized tensors (plain attributes, not
parameters: ``Module.to(dtype)`` would cast them) with a product of its format, ``product(rows, experts, kind,
counts)``. Its forward is then `forward`: transformers' grouped forward (the rows sorted by expert, each expert's
products over its run of rows, the outputs weighted and summed in fp32) with that product. Each kernel cuts the
sorted rows into tiles of one expert (`row_tiles`) on the device: no host sync, so the decode graphs capture kept
experts in any dtype (`layout_variants.experts_graph_reason`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch

__all__ = [
    "Product",
    "dequantized_product",
    "forward",
    "keep",
    "kept",
    "launch",
    "row_tiles",
    "servable",
    "servable_modules",
    "tile_rows",
]

# a kept format's grouped product: (rows sorted by expert, the experts module, "gate_up_proj" or "down_proj", each
# expert's count of rows) -> the products in the rows' dtype (the CPU's kernels: fp32, rounded once by `forward`)
Product = Callable[[torch.Tensor, torch.nn.Module, str, torch.Tensor], torch.Tensor]


def servable(experts: torch.nn.Module) -> bool:
    """Whether `experts` (transformers' experts module) has the layout `forward` runs: gated, gate and up
    concatenated, ``[experts, out, in]``, no bias, no norm after each expert."""
    return (
        getattr(experts, "has_gate", False)
        and getattr(experts, "is_concatenated", False)
        and not getattr(experts, "is_transposed", True)
        and not getattr(experts, "has_bias", True)
        and not getattr(experts, "has_post_expert_norm", True)
    )


def servable_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`model`'s experts modules that `keep` can serve (`servable`), by name."""
    return {n: m for n, m in model.named_modules() if n.endswith(".experts") and servable(m)}


def keep(
    experts: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    product: Product,
    kernel: str,
    down_pad: tuple[int, int] = (0, 0),
) -> None:
    """Make `experts` (`servable`) run on its quantized `tensors` by `product`: ``gate_up_proj`` and ``down_proj``
    (replacing the float parameters) and their scales (and zeros), by attribute name, each made contiguous; `kernel`
    names the format's kernel (`kept`). `down_pad`: the zero inputs before and after the module's own in down_proj's
    kept inputs (a tensor-parallel rank's run of inputs widened to whole blocks of scales,
    `expert_matrices.WholeBlocks`)."""
    for name, value in tensors.items():
        experts._parameters.pop(name, None)
        setattr(experts, name, value.contiguous())
    experts.__dict__["kept_product"] = product
    experts.__dict__["kept_kernel"] = kernel
    experts.__dict__["kept_down_pad"] = down_pad
    experts.__dict__["forward"] = types.MethodType(forward, experts)


def kept(experts: Any, kernel: str | None = None) -> bool:
    """Whether `experts` runs on quantized weights (`keep`), on the kernel `kernel` where given (``fp8``,
    ``int4``)."""
    found = getattr(experts, "__dict__", {}).get("kept_kernel")
    return found is not None and kernel in (None, found)


def forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A kept experts module's output ``[T, hidden]`` for its rows `hidden_states` ``[T, hidden]``, each routed to
    the experts `top_k_index` ``[T, k]`` with `top_k_weights`: transformers' grouped forward (the rows sorted by
    expert, each expert's products over its run, plus its biases where it has them, the outputs weighted and summed in
    fp32), its products the kept format's."""
    product = cast(Product, self.__dict__["kept_product"])
    apply_gate = cast(Callable[[torch.Tensor], torch.Tensor], self._apply_gate)
    experts, top_k = int(cast(torch.Tensor, self.gate_up_proj).shape[0]), top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(ids)
    rows = hidden_states[order // top_k]
    # counts by histc (no host sync, unlike bincount): float on a CPU, integers on CUDA (deterministic there)
    counted = sorted_ids.float() if sorted_ids.device.type == "cpu" else sorted_ids.int()
    counts = torch.histc(counted, bins=experts, min=0, max=experts - 1).long()

    def biased(y: torch.Tensor, kind: str) -> torch.Tensor:  # (each row's expert's bias: gpt-oss's experts have one)
        bias = getattr(self, f"{kind}_bias", None)
        return y if bias is None else y + cast(torch.Tensor, bias)[sorted_ids].to(y.dtype)

    gated = apply_gate(biased(product(rows, self, "gate_up_proj", counts), "gate_up_proj"))
    lead, trail = self.__dict__["kept_down_pad"]
    if lead or trail:  # (a rank's inputs of down_proj widened to whole blocks: `WholeBlocks`)
        gated = torch.nn.functional.pad(gated, (lead, trail))
    out = biased(product(gated, self, "down_proj", counts), "down_proj")
    out = out.float() * top_k_weights.reshape(-1)[order, None].float()
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(hidden_states.shape[0], top_k, -1).sum(dim=1).to(hidden_states.dtype)


def tile_rows(rows: int, experts: int) -> int:
    """The rows of a kernel's tile for `rows` routed rows over `experts` experts: 16 (the tensor cores' least) where
    an expert gets few rows (decode), 64 where they average 64 or more (prompts)."""
    return 64 if rows >= 64 * experts else 16


def row_tiles(counts: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each tile's expert, first row and end (``[tiles]`` int32 each) for `rows` rows sorted by expert (`counts`:
    each expert's rows), each expert's run cut into tiles of `block_m` rows, computed on the device. There are as
    many tiles as the rows could ever make (``cdiv(rows, block_m)``, plus one partial tile an expert with rows), so
    the grid's size depends on `rows` alone; the tiles past the last have first == end."""
    experts = counts.shape[0]
    most = -(-rows // block_m) + min(experts, rows)
    each = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(each, 0)
    row_ends = torch.cumsum(counts, 0)
    tile = torch.arange(most, device=counts.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_(max=experts - 1)
    first = row_ends[expert] - counts[expert] + (tile - (tile_ends[expert] - each[expert])) * block_m
    end = torch.minimum(first + block_m, row_ends[expert])
    end = torch.where(tile < tile_ends[-1], end, first)
    return expert.int(), first.int(), end.int()


def launch(
    kernel: Any,
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    outputs: int,
    tile: tuple[int, int, int, int],
    counts: torch.Tensor,
    strides: tuple[int, ...],
    **flags: Any,
) -> torch.Tensor:
    """A kept format's grouped product ``[S, outputs]`` in `x`'s dtype by its Triton `kernel` (jitted) for the rows of
    `x` ``[S, K]`` (contiguous) sorted by expert (`counts`: each expert's rows): the launch the formats share. The
    kernel takes ``(x, *weights, y, expert, first, end, outputs, K, x's row stride, y's, *strides)`` and the tile
    (`tile`: rows, outputs, inputs, warps) as ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, with the format's `flags`; its
    grid is the row tiles (`row_tiles`, found on the device) by the tiles of outputs."""
    rows, inputs = x.shape
    block_m, block_n, block_k, warps = tile
    tiles = row_tiles(counts, rows, block_m)
    y = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    grid = (tiles[0].shape[0], -(-outputs // block_n))
    kernel[grid](
        x, *weights, y, *tiles, outputs, inputs, x.stride(0), y.stride(0), *strides,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3, **flags,
    )  # fmt: skip
    return y


def dequantized_product(
    x: torch.Tensor, outputs: int, counts: torch.Tensor, weight_of: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """A kept format's grouped product by torch (a CPU's): ``x[r] @ W[e].T`` ``[S, outputs]`` in `x`'s dtype for the
    rows of `x` sorted by expert (`counts`: each expert's rows), each expert's weight de-quantized (`weight_of(e)`,
    ``[outputs, K]``) for its run of rows. A host sync reads the runs: never in a CUDA graph."""
    out = torch.zeros(x.shape[0], outputs, dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = x[start : start + count] @ weight_of(expert).to(x.dtype).t()
        start += count
    return out
