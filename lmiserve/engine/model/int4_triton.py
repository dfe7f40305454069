"""AWQ/GPTQ 4-bit weights on CUDA (issue #39): ``y = x @ W.T`` with ``W[n, k] = (code - zero[g(k), n]) *
scale[g(k), n]`` in one Triton kernel (`int4_triton_kernel`) that reads the codes once, as int32 words, and
unpacks them in registers: the weight is never written out in bf16, so a model takes a quarter of bf16's
memory and a decode step reads a quarter of its bytes.

History. The first kernel (one tile shape, the codes laid out ``[in / 8, out]``, a fp32 scale and zero read
per input through ``g_idx``) was correct on an H200 but 10-30x slower than the de-quantized bf16 products
(30-95 GB/s of weights, 2026-11-29, benchmarks/README.md), so AWQ/GPTQ are de-quantized to bf16 on CUDA
(`quant_formats.int4_module`) unless `USE_ON_CUDA` is set (``LMISERVE_USE_TRITON_INT4=1`` in the environment,
as vLLM's ``VLLM_USE_TRITON_AWQ``; the GPU check's 4-bit bench sets it) or, since 2026-12-03, the de-quantized
weights would not fit (`codes_kept`: more than `weight_fit.FIT_SHARE` of the GPU's free memory; a 70B AWQ model on one
80 GB GPU). This kernel (2026-11-30, not yet run on a GPU):

- the codes are ``[out, in / 8]`` (a tile is `BLOCK_N` runs of `BLOCK_K` / 2 bytes, and q/k/v or gate/up
  fuse by concatenating rows, as the fast path fuses every other weight: `llama_layout`);
- the groups must be runs of a multiple of `GROUP_TILE` consecutive inputs (AWQ's and GPTQ's groups;
  GPTQ's act-order too, once its inputs are stored in group order: the kernel reads the activations'
  columns in that order, `order`). A tensor-parallel rank's part of groups of unequal sizes (act-order inputs
  spread over the ranks, or a part that starts inside a group; `shard_quantized.cut_codes`) has each group padded
  to one such run, its pads code 0 times a zero column appended to the activations (`padded_layout`), where that
  stores at most twice the part's inputs. A tile's inputs share one group, whose scale and zero are applied once
  to the tile's sums (``scale * (sum x code - zero * sum x)``): one row of scales a tile, not one an input;
- tiles of per-row sums for 1-4 rows and of tensor-core products for more (`CANDIDATES`), chosen per
  weight shape and row bucket by measuring them on the GPU that serves, each checked against the
  de-quantized product first (`kernel_choice.pick`; a tile off by more than its tolerance never serves).
  If none passes, or a CUDA-graph capture meets a shape not measured before it, the product is computed from
  the weight de-quantized a slice at a time (`dequantized_product`: correct, slow, logged).

Layout (`Int4TritonLinear.from_parts`): ``weight`` int32 ``[out, in / 8]`` (nibble j of word r: input
8r + j of the stored order), `Int4Scales`: ``scales`` and ``zeros`` fp32 ``[groups, out]`` (zeros as
numbers of steps; a view of a fused tensor keeps its row stride), ``order`` int32 ``[in]`` or None.
`MEASURED_ON_CPU` lets the tests measure tiles of CPU tensors under Triton's interpreter; unmeasured CPU
tensors (the tests) run each bucket's first tile.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NamedTuple

import torch

from lmiserve.engine.model import kernel_choice, weight_fit
from lmiserve.engine.model.codes_linear import CodesLinear

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

log = logging.getLogger(__name__)

# AWQ/GPTQ on CUDA until this kernel is measured there (module doc): True (LMISERVE_USE_TRITON_INT4=1, as vLLM's
# VLLM_USE_TRITON_AWQ; the GPU check's 4-bit bench sets it): the codes on this kernel; False (=0): de-quantized to
# bf16 at load; None (unset): the codes kept where de-quantized they would not fit (`codes_kept`)
USE_ON_CUDA = kernel_choice.switch("LMISERVE_USE_TRITON_INT4")
MEASURED_ON_CPU = False
GROUP_TILE = 32  # the smallest tile's inputs: groups of a multiple of it are served
PADDED_AT_MOST = 2.0  # a `padded_layout`'s stored inputs at most this many times the weight's (half of bf16's bytes)
SLICE = 1024  # outputs de-quantized at a time by `dequantized_product`

__all__ = [
    "CANDIDATES",
    "GROUP_TILE",
    "USE_ON_CUDA",
    "Config",
    "Int4Scales",
    "Int4TritonLinear",
    "available",
    "bucket",
    "chosen",
    "codes_kept",
    "codes_kept_for",
    "dequantized_product",
    "group_layout",
    "int4_gemm",
    "int4_linear",
    "pack_nibbles",
    "padded_layout",
]


def codes_kept(dequantized_bytes: int, free_bytes: int) -> bool:
    """Whether a 4-bit checkpoint on CUDA keeps its codes on this kernel: as `USE_ON_CUDA` forces, else where its
    weights de-quantized to the compute dtype would not fit (`weight_fit.kept`)."""
    return weight_fit.kept(USE_ON_CUDA, dequantized_bytes, free_bytes)


def codes_kept_for(model: torch.nn.Module, device: torch.device, name: str) -> bool | None:
    """On CUDA, whether the 4-bit linears of `model` (on the meta device, its linears in the compute dtype: a whole
    model's, or a tensor-parallel rank's shell) keep their codes (`weight_fit.kept_for`), logged for the checkpoint
    `name`; None elsewhere."""
    if device.type != "cuda" or not available():
        return None
    switch = "LMISERVE_USE_TRITON_INT4"
    return weight_fit.kept_for(log, model, device, name, USE_ON_CUDA, switch, "4-bit codes on the Triton kernel")


def available() -> bool:
    return triton is not None


Config = kernel_choice.Tile  # one tile of the kernel (`fitted` to the groups: `block_k` divides them)


def bucket(rows: int) -> int:
    """The row count a choice is measured at and kept for: 1, 4 (2-4 rows), 16 (5-16) or 64 (more)."""
    return 1 if rows <= 1 else 4 if rows <= 4 else 16 if rows <= kernel_choice.DECODE_ROWS else 64


# the sum tiles keep at most 64 products a thread in registers (rows x outputs x inputs / threads); decode
# rows also try K split between 4 programs (at one row an 8B model's products read 170-525 GB/s on an H200 with
# every program walking all of K: `fp8_gemv`'s reason for its split tiles), added by each tile's last program
CANDIDATES: dict[int, tuple[Config, ...]] = {
    1: (
        Config(False, 1, 32, 128),
        Config(False, 1, 64, 128),
        Config(False, 1, 16, 256),
        Config(False, 1, 64, 256, num_warps=8),
        Config(False, 1, 32, 128, split_k=4, adds_in_kernel=True),
        Config(False, 1, 16, 256, split_k=4, adds_in_kernel=True),
    ),
    4: (
        Config(False, 4, 16, 128),
        Config(False, 4, 32, 64),
        Config(True, 16, 32, 128),
        Config(True, 16, 64, 64),
        Config(False, 4, 16, 128, split_k=4, adds_in_kernel=True),
        Config(True, 16, 32, 128, split_k=4, adds_in_kernel=True),
    ),
    16: (
        Config(True, 16, 32, 128),
        Config(True, 16, 64, 64),
        Config(True, 16, 64, 128),
        Config(True, 16, 128, 64, num_warps=8),
        Config(True, 16, 32, 128, split_k=4, adds_in_kernel=True),
        Config(True, 16, 64, 64, split_k=4, adds_in_kernel=True),
    ),
    64: (
        Config(True, 32, 64, 64),
        Config(True, 64, 64, 64),
        Config(True, 64, 128, 32, num_warps=8),
        Config(True, 32, 128, 64, num_warps=8),
    ),
}


class Int4Scales(NamedTuple):
    """What a 4-bit weight's codes need besides themselves: ``scales`` and ``zeros`` fp32 ``[groups, out]``
    (row stride kept: a view of fused ones), the activations' column `order` (act-order; None: in order) and
    the groups' size `group` (a multiple of `GROUP_TILE`)."""

    scales: torch.Tensor
    zeros: torch.Tensor
    order: torch.Tensor | None
    group: int


@functools.cache
def _kernel() -> Any:
    from lmiserve.engine.model.int4_triton_kernel import int4_gemm_kernel

    return triton.jit(int4_gemm_kernel)


def int4_gemm(x: torch.Tensor, weight: torch.Tensor, parts: Int4Scales, config: Config) -> torch.Tensor:
    """``x @ W.T`` in `x`'s dtype for a 2-D `x` ``[M, K]`` and a 4-bit weight (codes ``[N, K / 8]``, `parts`),
    with the tile `config` (its `block_k` must divide the groups)."""
    if triton is None:
        raise RuntimeError("the int4 Triton kernel needs triton")
    if parts.group % config.block_k:
        raise ValueError(f"groups of {parts.group} inputs are not a multiple of the tile's {config.block_k}")
    x = _widened(x, weight).contiguous()
    rows, inputs = x.shape
    order = parts.order if parts.order is not None else weight  # (unread without HAS_ORDER)

    def launch(
        y: torch.Tensor,
        sums: torch.Tensor,
        counters: torch.Tensor,
        grid: tuple[int, int, int],
        k_share: int,
        split: int,
    ) -> None:
        _kernel()[grid](
            x, weight, parts.scales, parts.zeros, order, y, rows, weight.shape[0], inputs, x.stride(0),
            y.stride(0), parts.scales.stride(0), k_share, sums, counters, sums.stride(0) if split else 0,
            GROUP=parts.group, HAS_ORDER=parts.order is not None, USE_DOT=config.use_dot,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=split,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip

    return kernel_choice.split_k_product(config, x, weight, launch)


def dequantized_product(x: torch.Tensor, weight: torch.Tensor, parts: Int4Scales) -> torch.Tensor:
    """``x @ W.T`` computed in fp32 from the weight de-quantized `SLICE` outputs at a time (no whole copy of
    it): the tiles' reference, and the product where no tile serves."""
    inputs = weight.shape[1] * 8
    cols = _widened(x.float(), weight)
    if parts.order is not None:
        cols = cols.index_select(1, parts.order.long())
    groups = torch.arange(inputs, device=x.device) // parts.group
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    pieces = []
    for start in range(0, weight.shape[0], SLICE):
        words = weight[start : start + SLICE]
        codes = ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], inputs).float()
        zeros = parts.zeros[:, start : start + SLICE].t()[:, groups]
        scales = parts.scales[:, start : start + SLICE].t()[:, groups]
        pieces.append(cols @ ((codes - zeros) * scales).t())
    return torch.cat(pieces, dim=1).to(x.dtype)


_chosen: dict[tuple[Any, ...], Config | None] = {}  # (device, N, K, group, act-order, bucket, dtype) -> tile


def chosen() -> dict[tuple[Any, ...], Config | None]:
    """The choices made so far (the GPU check reports them; None: `dequantized_product`)."""
    return dict(_chosen)


def choose(x: torch.Tensor, weight: torch.Tensor, parts: Int4Scales) -> Config | None:
    """The tile for ``x @ W.T`` (None: `dequantized_product`), measured the first time a shape and row bucket
    comes outside a CUDA-graph capture (module doc)."""
    rows = bucket(x.shape[0])
    key = (x.device, weight.shape[0], weight.shape[1] * 8, parts.group, parts.order is not None, rows, x.dtype)
    if key in _chosen:
        return _chosen[key]
    candidates = tuple(dict.fromkeys(c.fitted(parts.group) for c in CANDIDATES[rows]))
    if not (x.is_cuda or MEASURED_ON_CPU):
        return candidates[0]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        log.warning(
            "int4 products [%d x %d] at %d rows first met in a CUDA graph's capture: de-quantized a slice at a "
            "time (slow)", weight.shape[0], key[2], x.shape[0],
        )  # fmt: skip
        return None
    try:
        choice = _measure(key, weight, parts, candidates)
    except Exception as exc:  # noqa: BLE001 - measuring failed (memory, the GPU): the first tile, unchecked
        log.warning("measuring the int4 Triton kernel for [%d x %d] failed (%s): its first tile serves", *key[1:3], exc)
        choice = candidates[0]
    _chosen[key] = choice
    return choice


def _measure(
    key: tuple[Any, ...], weight: torch.Tensor, parts: Int4Scales, candidates: tuple[Config, ...]
) -> Config | None:
    device, outputs, inputs, _, _, rows, dtype = key
    generator = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn(rows, inputs, generator=generator, device=device).to(dtype)
    return kernel_choice.pick(
        log,
        "int4",
        (outputs, inputs, rows),
        candidates,
        lambda config: int4_gemm(probe, weight, parts, config),
        dequantized_product(probe.float(), weight, parts),
        device,
        ("the de-quantized product", None),
    )


def int4_linear(x: torch.Tensor, weight: torch.Tensor, parts: Int4Scales) -> torch.Tensor:
    """``x @ W.T`` for a 2-D `x`: the measured tile (`choose`), or `dequantized_product` where none serves."""
    config = choose(x, weight, parts)
    if config is None:
        return dequantized_product(x, weight, parts)
    return int4_gemm(x, weight, parts, config)


def pack_nibbles(nibbles: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``[..., 8]`` values 0..15 as one int32 word each (nibble k at bits 4k), two's complement kept: the
    kernel's codes, and GPTQ's and AWQ's packing (models/quant_pack.py); of `bits` 8, ``[..., 4]`` bytes (byte k at
    bits 8k: GPTQ's 8-bit codes). The inverse of `quant_formats.unpack_words`."""
    count = 32 // bits
    words = (nibbles.long() << (torch.arange(count, device=nibbles.device) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def group_layout(g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor | None, int | None]:
    """How the kernel can read a weight whose input i is in group ``g_idx[i]``: the inputs' `order` that
    makes every group a run of consecutive inputs (None: they already are; GPTQ's act-order: sorted by
    group), and those runs' size, or None when the groups are not runs of one size (then `order` is None)."""
    order = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):
        order = torch.argsort(g_idx, stable=True)
        g_idx = g_idx[order]
    inputs = g_idx.shape[0]
    if not groups or inputs % groups:
        return None, None
    size = inputs // groups
    expected = torch.arange(inputs, device=g_idx.device) // size
    if not torch.equal(g_idx.long(), expected):
        return None, None
    return order, size


def padded_layout(g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor, int] | None:
    """How the kernel reads a weight whose groups are of unequal sizes (a tensor-parallel rank's part of GPTQ's
    act-order inputs, or of inputs that start or end inside a group: `shard_quantized.cut_codes`): the inputs
    sorted by group, each group's run padded to `size` inputs (its largest run rounded up to `GROUP_TILE`) with the
    index ``len(g_idx)``, a zero column the products append to the activations (`_widened`), so the pads add
    nothing. ``(order [groups * size], size)``; None where that is more than `PADDED_AT_MOST` times the inputs
    (half of bf16's bytes)."""
    inputs = g_idx.shape[0]
    if not inputs or not groups:
        return None
    counts = torch.bincount(g_idx.long(), minlength=groups)
    size = -(-int(counts.max()) // GROUP_TILE) * GROUP_TILE
    if groups * size > PADDED_AT_MOST * inputs:
        return None
    by_group = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx.long()[by_group]
    firsts = torch.cumsum(counts, 0) - counts  # each group's first position among the sorted inputs
    order = torch.full((groups, size), inputs, dtype=torch.long, device=g_idx.device)
    order[sorted_groups, torch.arange(inputs, device=g_idx.device) - firsts[sorted_groups]] = by_group
    return order.reshape(-1), size


def _widened(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` with zero columns up to the codes' inputs, where it has fewer (a `padded_layout`'s pads read them)."""
    missing = weight.shape[1] * 8 - x.shape[1]
    return torch.nn.functional.pad(x, (0, missing)) if missing > 0 else x


class Int4TritonLinear(CodesLinear):
    """A 4-bit AWQ/GPTQ linear on `int4_linear`: `weight` the codes, int32 ``[out, in / 8]``, and `scales` its
    `Int4Scales` (plain attributes, as `quantize.Int8Linear`'s: the fast path points them at rows of the
    fused q/k/v and gate/up weights, `llama_layout`)."""

    def __init__(self, weight: torch.Tensor, scales: Int4Scales, bias: torch.Tensor | None, in_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.weight, self.scales, self.bias = weight, scales, bias

    @staticmethod
    def layout(g_idx: torch.Tensor, groups: int) -> tuple[torch.Tensor | None, int] | None:
        """How the kernel reads a weight of these groups (``(order, size)``, `Int4Scales`' ``order`` and ``group``):
        runs of a multiple of `GROUP_TILE` inputs, in order or once sorted (`group_layout`), else each group padded
        to one size (`padded_layout`); None where neither serves."""
        order, size = group_layout(g_idx, groups)
        if size is not None and size % GROUP_TILE == 0:
            return order, size
        return padded_layout(g_idx, groups)

    @classmethod
    def from_parts(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        g_idx: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        layout: tuple[torch.Tensor | None, int] | None = None,
    ) -> Int4TritonLinear:
        """From codes ``[out, in]``, scale and zero ``[out, groups]`` (`quant_formats.Int4Parts`) whose groups
        the kernel reads (their `layout`, given where the caller asked it; ValueError where there is none). Act-order
        inputs are stored in group order; each call reads the activations' columns in that order (a padded group's
        pads: code 0 times a zero column)."""
        layout = cls.layout(g_idx, scale.shape[1]) if layout is None else layout
        if layout is None:
            raise ValueError(
                f"the int4 kernel reads groups of a multiple of {GROUP_TILE} consecutive inputs, or groups padded to "
                f"such runs within {PADDED_AT_MOST:g}x the inputs"
            )
        order, size = layout
        in_features = codes.shape[1]
        if order is not None:
            codes = torch.nn.functional.pad(codes, (0, 1))[:, order]  # (index in_features: a pad, code 0)
        out, inputs = codes.shape
        words = pack_nibbles(codes.reshape(out, inputs // 8, 8))
        parts = Int4Scales(
            scale.t().contiguous().to(device, torch.float32),  # fp32: a fp16 scale exactly (bf16 would round it)
            zero.t().contiguous().to(device, torch.float32),
            None if order is None else order.to(device, torch.int32),
            size,
        )
        b = None if bias is None else bias.detach().to(device, dtype)
        return cls(words.contiguous().to(device), parts, b, in_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return int4_linear(rows, self.weight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit (Triton)"
