"""A mixture of experts' quantized experts kept quantized on a CPU (issue #39): fp8 experts (Qwen3-30B-A3B-FP8,
RedHatAI's and ModelOpt's fp8 MoEs, ``quantize=fp8`` on a float MoE), symmetric 8-bit codes (GPTQ-Int8, W8A16, W8A8),
4-bit AWQ/GPTQ codes (Qwen3-30B-A3B-GPTQ-Int4, Mixtral AWQ) and gpt-oss's MXFP4 experts on the CPU's group kernels
(`group_kernels`: the q8 and q4 kernels the linears run on, `cpu_codes`; the f4 kernel of 4-bit floats).

Why: on a CPU, computing in fp32, the loader de-quantized such experts to fp32 at load: 4 times an fp8 or 8-bit
model's experts, 8 times a 4-bit one's, and the experts are most of such a model. Qwen1.5-MoE-A2.7B's GPTQ-Int4
(about 8 GB) took 57 GB, OLMoE-1B-7B in fp8 (7 GB) 28 GB, gpt-oss-20b (13 GB) about 84 GB; and a decode step reads
every routed expert's weight.

Kept, each expert's matrices are stored in the kernels' blocked layout (`pack_q8`, `pack_q4`, `pack_f4`; stacked
``[experts, out / 16, ...]``) with their scales repeated over the kernel's groups of 32 (or 16) inputs, every weight
exactly the checkpoint's. The module's forward is `grouped_experts.forward` with `grouped_product`: each expert's run
of rows through its own packed matrix (`group_kernels.Packed`, made once), into one output. A host loop over the
experts hit: the CPU has no decode graphs to keep it out of.

Kept where the kernels run (numba), in any compute dtype (fp32, a CPU's default, or bf16: the rows are widened to fp32
for the kernels, the products, gate and weighted sum stay fp32 and the module's output is rounded once; before
2026-12-07 bf16 de-quantized them, four times a 4-bit checkpoint's bytes), for outputs a multiple of 16 and groups of
inputs that the kernel takes (q8: runs of 16n inputs a scale, or one a row; q4: groups of 32n; f4: MXFP4's blocks of
32); else (`keep_q8`, `keep_q4` and `keep_mxfp4` answer False) the experts are de-quantized as before. GPTQ's act-order
4-bit experts keep their order of inputs: each expert's rows are gathered in it first."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, cast

import torch

from lmiserve.engine.model import grouped_experts
from lmiserve.engine.model.cpu_codes import q4_runs, q8_runs
from lmiserve.engine.model.group_kernels import LANES, Q4_GROUP, Packed, available, pack_f4, pack_q4, pack_q8
from lmiserve.engine.model.quant_formats import unpack_words

log = logging.getLogger(__name__)

__all__ = ["KERNELS", "grouped_product", "keep_mxfp4", "keep_q4", "keep_q8", "kept_for", "kernel_named"]

KERNELS = ("q8", "q4", "f4")  # (`grouped_experts.kept`'s names of these experts' kernels)


def kept_for(model: torch.nn.Module, device: torch.device, name: str, what: str) -> bool:
    """Whether `what` experts of `model` (on the meta device in the compute dtype: a whole model's, or a
    tensor-parallel rank's shell) stay quantized on the CPU `device`: where the group kernels run (numba), whatever
    the model computes in (fp32, its default there, or ``dtype=bf16``: the kernels take the rows widened to fp32 and
    the module's output is rounded to the compute dtype once, `grouped_experts.forward`); logged for the checkpoint
    `name`."""
    if device.type != "cpu":
        return False
    keep = available()
    why = (
        "on the CPU's group kernels" if keep else "de-quantized at load (no numba: the CPU's group kernels do not run)"
    )
    log.info("%s: %s experts %s", name, what, why)
    return keep


def keep_q8(
    experts: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], down_pad: tuple[int, int]
) -> bool:
    """Make `experts` (`grouped_experts.servable`) run on the q8 kernel over `weights` (by kind: 8-bit codes
    ``[experts, out, in]``, fp8 e4m3fn or signed int8, with fp32 scales ``[experts, out]``, a channel's, or
    ``[experts, out, blocks]``, each row's by runs of ``in / blocks`` inputs); False (nothing changed) where the kernel
    does not take them. `down_pad`: `grouped_experts.keep`'s; down_proj's inputs under a scale a row are widened
    with zeros to a multiple of 16 (a tensor-parallel rank's part)."""
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, (codes, scales) in weights.items():
        count, out, inputs = codes.shape
        rows = scales.float().reshape(count, out, -1)
        widen = (-inputs) % LANES if kind == "down_proj" and rows.shape[2] == 1 else 0
        if widen:  # (a scale a row over a rank's part of down_proj's inputs, 24 of 48: zero inputs after it)
            raw = codes.view(torch.uint8)
            codes = torch.cat([raw, raw.new_zeros(count, out, widen)], dim=2).view(codes.dtype)
            inputs, down_pad = inputs + widen, (down_pad[0], down_pad[1] + widen)
        runs = [q8_runs(rows[e], inputs) for e in range(count)]
        if out % LANES or any(r is None for r in runs):
            return False
        made[kind] = _stacked(count, (pack_q8(codes[e], cast(torch.Tensor, runs[e])) for e in range(count)))
    _keep(experts, made, {}, "q8", down_pad)
    return True


def keep_mxfp4(
    experts: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], down_pad: tuple[int, int]
) -> bool:
    """Make `experts` run on the f4 kernel over MXFP4 `weights` (by kind, as `mxfp4_experts.keep` takes them: uint8
    bytes ``[experts, out, in / 2]``, two e2m1 codes a byte, the low nibble first, and uint8 powers ``[experts, out,
    in / 32]``, a block's ``2 ** (s - 127)``): each expert's codes as they are, half a byte a weight, its blocks'
    powers as fp32 scales; every weight the checkpoint's. False (nothing changed) where the kernel does not take them
    (outputs not a multiple of 16). `down_pad`: `grouped_experts.keep`'s."""
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, (blocks, powers) in weights.items():
        count, out = blocks.shape[:2]
        if out % LANES:
            return False
        nibbles = (torch.stack([b & 0xF, b >> 4], dim=-1).flatten(1) for b in blocks)  # (the low nibble first)
        made[kind] = _stacked(count, (pack_f4(n, torch.exp2(p.float() - 127.0)) for n, p in zip(nibbles, powers)))
    _keep(experts, made, {}, "f4", down_pad)
    return True


def keep_q4(experts: torch.nn.Module, weights: dict[str, tuple[torch.Tensor, ...]], down_pad: tuple[int, int]) -> bool:
    """Make `experts` (`grouped_experts.servable`) run on the q4 kernel over 4-bit `weights` (by kind, as
    `int4_experts.keep` takes them: int32 words ``[experts, out, in / 8]``, fp32 scales and zeros ``[experts, groups,
    out]``, ``w = (code - zero) * scale``, and with GPTQ's act-order each expert's order of inputs ``[experts, in]``);
    False (nothing changed) where the kernel does not take them. `down_pad`: `grouped_experts.keep`'s."""
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    orders: dict[str, torch.Tensor] = {}
    for kind, (words, scales, zeros, *order) in weights.items():
        count, out, inputs = words.shape[0], words.shape[1], words.shape[2] * 8
        group = inputs // scales.shape[1]
        if out % LANES or group % Q4_GROUP or group * scales.shape[1] != inputs:
            return False
        codes = (unpack_words(w).reshape(out, inputs) for w in words)
        runs = (q4_runs(s.t(), z.t(), group) for s, z in zip(scales, zeros, strict=True))
        made[kind] = _stacked(count, (pack_q4(c, *r) for c, r in zip(codes, runs, strict=True)))
        if order:
            orders[kind] = order[0].long()
    _keep(experts, made, orders, "q4", down_pad)
    return True


def _stacked(count: int, packs: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` experts' packed matrices and scales (`packs`: each expert's, made as they are read) stacked
    ``[experts, ...]``, each written into the stack as it is made: a layer's packed experts held once, not twice."""
    codes = scales = torch.empty(0)
    for e, (c, s) in enumerate(packs):
        if e == 0:
            codes, scales = c.new_empty(count, *c.shape), s.new_empty(count, *s.shape)
        codes[e], scales[e] = c, s
    return codes, scales


def kernel_named(modules: list[torch.nn.Module]) -> str:
    """What a start's account calls the kernel of the kept experts `modules` (`grouped_experts.kept`): the CPU's q8,
    q4 or f4 kernel, else the Triton kernel (a GPU's)."""
    cpu = sorted({module.__dict__["kept_kernel"] for module in modules} & set(KERNELS))
    return f"the CPU's {cpu[0]} kernel" if cpu else "Triton kernel"


def _keep(
    experts: torch.nn.Module,
    made: dict[str, tuple[torch.Tensor, torch.Tensor]],
    orders: dict[str, torch.Tensor],
    kernel: str,
    down_pad: tuple[int, int],
) -> None:
    tensors = {}
    for kind, (codes, scales) in made.items():
        tensors.update({kind: codes, f"{kind}_scales": scales})
        if kind in orders:
            tensors[f"{kind}_order"] = orders[kind]
    grouped_experts.keep(experts, tensors, _product, kernel, down_pad)
    # each expert's matrix as the kernel's numpy views, made once (the tensors above are contiguous, never moved)
    experts.__dict__["kept_packed"] = {
        kind: [Packed(getattr(experts, kind)[e], getattr(experts, f"{kind}_scales")[e]) for e in range(len(codes))]
        for kind, (codes, _) in made.items()
    }


def _product(x: torch.Tensor, experts: torch.nn.Module, kind: str, counts: torch.Tensor) -> torch.Tensor:
    packed = cast(list[Packed], experts.__dict__["kept_packed"][kind])
    return grouped_product(x, packed, counts, cast(torch.Tensor | None, getattr(experts, f"{kind}_order", None)))


def grouped_product(
    x: torch.Tensor, packed: list[Any], counts: torch.Tensor, order: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[r] @ W[e].T`` (fp32 ``[S, outputs]``) for the rows of `x` ``[S, K]`` sorted by expert (the first
    ``counts[0]`` routed to expert 0, the next ``counts[1]`` to expert 1, ...), ``W[e]`` expert e's packed matrix
    (`packed[e]`, a `group_kernels.Packed`), its rows gathered in the expert's stored order of inputs (`order`
    ``[experts, K]``, GPTQ's act-order; None: in order)."""
    rows = x.detach().float().contiguous()
    out = torch.empty(rows.shape[0], packed[0].n, dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            run = rows[start : start + count]
            if order is not None:
                run = run[:, order[expert]].contiguous()
            packed[expert](run.numpy(), out[start : start + count].numpy())
        start += count
    return out
