"""A checkpoint's integer-coded experts read for the kernels that keep them (`int4_experts`' 4-bit codes,
`int8_experts`' 8-bit ones): what both formats' loaders share. Each expert's matrix is unpacked whole
(`shard_quantized.int4_parts`: AWQ's, GPTQ's or compressed-tensors' codes), read by a format's `Reader` as one row an
output (codes, then scales and zeros as bytes or words) so that `stacked_experts` stacks a module's experts (and cuts
a tensor-parallel rank's part) in one read, then split by the format and `keep`-ed."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from lmiserve.engine.model import grouped_experts
from lmiserve.engine.model.expert_matrices import Read, WholeBlocks, stacked_experts
from lmiserve.engine.model.shard_quantized import int4_parts

if TYPE_CHECKING:
    from lmiserve.engine.model.quant_formats import Int4Parts, QuantSpec

__all__ = ["Format", "Reader", "cut", "keep_stored", "stacked_rows"]


class Format(Protocol):
    """A coded experts format: its module (`int4_experts`, `int8_experts`), read at each call (tests replace its
    `kept_for`)."""

    KEPT: str  # what the start's account calls kept experts

    def takes(self, quant: QuantSpec) -> bool:
        """Whether the checkpoint's codes (`quant`) are this format's."""

    def kept_for(self, model: torch.nn.Module, device: torch.device, name: str) -> bool:
        """Whether the kernel keeps `model`'s experts on `device` (logged for `name`)."""

    def stacked(
        self,
        owner: str,
        count: int,
        names: Any,
        parts_of: Callable[[str], Int4Parts],
        part: Callable[[int], slice],
        inputs: Callable[[int], slice] | None = None,
    ) -> Mapping[str, tuple[torch.Tensor, ...]] | None:
        """The kernel's tensors of the experts module `owner`, by kind (`inputs`: down_proj's, `WholeBlocks`); None:
        de-quantized instead."""

    def keep(self, experts: torch.nn.Module, weights: Any, down_pad: tuple[int, int] = (0, 0)) -> bool:
        """Make `experts` run on `weights` (`stacked`'s, on the device; `down_pad`: `grouped_experts.keep`'s); whether
        they are kept (False: the device's kernel does not take them, nothing changed)."""


class Reader(Protocol):
    """A format's reader of one expert's unpacked matrix (`parts`), recording what it read in `seen`."""

    def __init__(self, parts: Int4Parts, seen: dict[str, Any]) -> None: ...

    def get_shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def cut(index: Any, inputs: int, group: int) -> tuple[Any, int, int]:
    """The rows and the run of inputs (first, end) of `index` (``[rows]`` or ``[rows, inputs]``, as
    `stacked_experts` reads) of a matrix of `inputs` inputs in groups of `group` (0: a scale a row): LookupError
    where the run does not start a group and end one or the row (a tensor-parallel rank's part of down_proj)."""
    rows, run = index if isinstance(index, tuple) else (index, slice(None))
    first, end, _ = run.indices(inputs)
    if group and (first % group or (end % group and end != inputs)):
        raise LookupError(f"inputs {first}:{end} are not whole groups of {group}")
    return rows, first, end


def stacked_rows(
    owner: str,
    kind: str,
    count: int,
    names: Any,
    parts_of: Callable[[str], Int4Parts],
    part: Callable[[int], slice],
    reader: type[Reader],
    inputs: Callable[[int], slice] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """The experts tensor ``owner.kind`` as `reader`'s rows, stacked from each expert's matrix (`stacked_experts`,
    with `part` and `inputs`), and what the reader `seen` (each read's record); None where the checkpoint does not
    store it so or `reader` does not read one of its matrices (LookupError)."""
    seen: dict[str, Any] = {}
    try:
        rows = stacked_experts(
            owner, kind, count, names, lambda n: reader(parts_of(n.removesuffix(".weight")), seen), part, inputs
        )
    except LookupError:
        return None
    return None if rows is None else (rows, seen)


def keep_stored(
    model: torch.nn.Module,
    names: Any,
    read: Read,
    quant: QuantSpec,
    device: torch.device,
    name: str,
    codes: Format,
    part: Callable[[int], slice] = lambda size: slice(0, size),
    decided: bool | None = None,
) -> set[str]:
    """A checkpoint's experts kept as their codes where they are `codes`' format (`quant`) and its `kept_for` says so
    for `model` (the meta model, or a tensor-parallel rank's shell; `name`: the checkpoint's or the rank's, for the
    log): each servable experts module read from the checkpoint (`names`; `read`: a tensor's slice, unpacked by
    `int4_parts`; `part` of every expert's intermediate size: a rank's, `ShardPlan.part`, down_proj's inputs widened
    to whole groups: `WholeBlocks`) by the format's `stacked` and `keep`-ed on `device`; their names (the others are
    left to be de-quantized). `decided`: the linears' decision by the same rule (`quant_formats.weights_kept_for`),
    so that it is made and logged once; None: the format's `kept_for` is asked."""
    if not codes.takes(quant):
        return set()
    found = grouped_experts.servable_modules(model)
    if not found or not (codes.kept_for(model, device, name) if decided is None else decided):
        return set()
    parts_of = functools.partial(int4_parts, names=names, read=read, quant=quant)
    made = set()
    for owner, module in found.items():
        count, down = int(cast(torch.Tensor, module.down_proj).shape[0]), WholeBlocks(part, max(quant.group_size, 0))
        weights = codes.stacked(owner, count, names, parts_of, part, down)
        if weights is not None:
            kept = {kind: tuple(t.to(device) for t in parts) for kind, parts in weights.items()}
            if codes.keep(module, kept, down.pad):
                made.add(owner)
    return made
