"""LoRA adapters in fixed slots, so that decode steps with adapters replay CUDA graphs too
(engine/attention/cuda_graphs.py).

`LoraBatch` (engine/lora/batch.py) stacks the matrices of each step's set of adapters: its tensors change
shape and address with the set, which a captured graph cannot follow. Here the matrices live in buffers
allocated once, as vLLM's punica wrapper keeps them: `max_loras` slots of `max_lora_rank` columns each.
For a group of linears that read one input (the fast path's fused q/k/v, o, gate/up, down), ``A [parts x
slots x rank, in]`` holds part after part, slot after slot, each slot's ``rank`` rows, and each part has its
``s B [out, slots x rank]``; an adapter of a lower rank, or one that does not adapt a part, leaves zeros
there. Each row's slot sits in a device buffer of fixed address (-1: the base model, or a padding row).

A step's products, for every group: ``low = x @ A^T``; ``low`` masked to the columns of each row's slot
(one mask a step, made from the row slots inside the graph); ``out[:, part] += low_part @ B_part^T``:
1 + parts calls a group whatever the adapters. The work wasted on other slots' columns is ``slots x rank``
columns a linear (64 at the defaults, 4 slots of rank 16: about 2.5 % of an 8B model's products), and a step
of the base model alone pays it too (its rows' slots -1), as vLLM's graphs do with LoRA enabled.

A step's adapters (at most `max_loras`: the scheduler's limit) keep their slots; an adapter not in a slot
takes a free one, else the slot of the least recently used adapter the step does not use, and its
matrices are copied in (on the device's stream: after the step before reads the slot). The buffers' bytes
(`slot_bytes`) are reserved beside the KV pool (engine/pool_plan.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmiserve.engine.lora.adapters import FAST_PATH_MODULES, LoraAdapter, linear_shape
from lmiserve.engine.lora.batch import LoraBatch, LoraGroup

__all__ = ["NO_SLOT", "LoraSlots", "SlotProducts", "slot_bytes"]

NO_SLOT = -1  # a row of the base model (or padding): its mask is zero


def slot_bytes(model: torch.nn.Module, slots: int, rank: int) -> int:
    """The bytes of `LoraSlots` for `model` (its fast path's linears, ``(in + out) x slots x rank`` each,
    in the model's dtype), computed from the model before the slots exist (the pool plan's reserve)."""
    dtype = next(model.parameters()).dtype
    widths = 0
    for name, module in model.named_modules():
        shape = linear_shape(module) if name.rsplit(".", 1)[-1] in FAST_PATH_MODULES else None
        if shape is not None:
            widths += shape[0] + shape[1]
    return widths * slots * rank * dtype.itemsize


@dataclass
class _Group:
    """A group's slot buffers: A (``[parts x slots x rank, in]``) and each part's output columns and B."""

    paths: tuple[str, ...]
    a: torch.Tensor
    b: list[tuple[slice, torch.Tensor]]


class LoraSlots:
    """`slots` adapters of rank at most `rank` in fixed buffers, for the fast path's `groups`, on `device` in
    `dtype`, and the slot of each of up to `max_rows` rows."""

    def __init__(
        self,
        groups: Sequence[LoraGroup],
        slots: int,
        rank: int,
        max_rows: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if slots < 1 or rank < 1:
            raise ValueError("LoRA slots need at least one slot of rank 1")
        self.slots, self.rank, self.dtype = slots, rank, dtype
        width = slots * rank
        self.groups: dict[str, _Group] = {}  # by group key
        for group in groups:
            if group.inputs < 1:
                raise ValueError(f"LoRA group {group.key} does not say its input width")
            a = torch.zeros(len(group.parts) * width, group.inputs, dtype=dtype, device=device)
            b = [
                (slice(first, end), torch.zeros(end - first, width, dtype=dtype, device=device))
                for _, first, end in group.parts
            ]
            self.groups[group.key] = _Group(tuple(path for path, _, _ in group.parts), a, b)
        # the slot each column of a part's low-rank activations belongs to; each row's slot (fixed addresses)
        self.column_slots = torch.arange(slots, device=device).repeat_interleave(rank)
        self.row_slots = torch.full((max_rows,), NO_SLOT, dtype=torch.int64, device=device)
        self._host_rows = torch.full((max_rows,), NO_SLOT, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_view = self._host_rows.numpy()  # (made once: a step writes it with no torch call)
        self._holder: list[int | None] = [None] * slots  # the adapter id in each slot
        self._used = [0] * slots
        self._clock = itertools.count(1)

    @property
    def nbytes(self) -> int:
        return sum(g.a.nbytes + sum(b.nbytes for _, b in g.b) for g in self.groups.values())

    def holders(self) -> list[int | None]:
        """The adapter id in each slot (None: empty)."""
        return list(self._holder)

    def place(self, adapters: Sequence[LoraAdapter]) -> list[int]:
        """The slot of each of a step's `adapters`, copying in those not in one yet (ValueError: more
        adapters than slots, or an adapter of a rank above the slots')."""
        if len(adapters) > self.slots:
            raise ValueError(f"{len(adapters)} adapters in one step, {self.slots} LoRA slots")
        wanted = {adapter.id for adapter in adapters}
        placed = []
        for adapter in adapters:
            if adapter.id in self._holder:
                slot = self._holder.index(adapter.id)
            else:
                slot = self._free(wanted)
                self._load(slot, adapter)
            self._used[slot] = next(self._clock)
            placed.append(slot)
        return placed

    def set_step(self, lora: LoraBatch | None, rows: int, size: int) -> None:
        """A step of `rows` rows padded to `size`, with the adapters of `lora` (its token rows: these rows;
        None: none): its adapters placed in slots, then each row's slot (`NO_SLOT`: none, as every padding
        row) copied into `row_slots` (asynchronously from pinned memory on CUDA, as the graphs' other
        inputs, and with them: `DecodeGraphs._fill` writes the pinned buffer again only once the step before's
        copies are done, also where a chained step runs before that step is received). An adapter placed
        here is copied on the device's stream, after the steps queued before it that read its slot."""
        host = self._host_view
        if lora is None:
            host[:size] = NO_SLOT
        else:
            placed = self.place(lora.adapters)
            host[:rows] = [placed[owner] if owner >= 0 else NO_SLOT for owner in lora.owners[:rows]]
            host[rows:size] = NO_SLOT
        self.row_slots[:size].copy_(self._host_rows[:size], non_blocking=self._host_rows.is_pinned())

    def _free(self, keep: set[int]) -> int:
        """An empty slot, else the least recently used one whose adapter is not in `keep`."""
        if None in self._holder:
            return self._holder.index(None)
        candidates = [s for s, held in enumerate(self._holder) if held not in keep]
        return min(candidates, key=self._used.__getitem__)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s matrices into `slot` (zeros past its rank and for the linears it leaves)."""
        if adapter.rank > self.rank:
            raise ValueError(f"adapter {adapter.name} has rank {adapter.rank}, the LoRA slots {self.rank}")
        self._holder[slot] = None  # a failed copy leaves the slot empty, not half another adapter's
        rank, width = self.rank, self.slots * self.rank
        for group in self.groups.values():
            for part, (path, (_, b)) in enumerate(zip(group.paths, group.b, strict=True)):
                a_rows = group.a[part * width + slot * rank : part * width + (slot + 1) * rank]
                b_cols = b[:, slot * rank : (slot + 1) * rank]
                pair = adapter.modules.get(path)
                if pair is None:
                    a_rows.zero_()
                    b_cols.zero_()
                    continue
                a, scaled_b = pair
                r = a.shape[0]
                a_rows[:r].copy_(a)
                a_rows[r:].zero_()
                b_cols[:, :r].copy_(scaled_b)
                b_cols[:, r:].zero_()
        self._holder[slot] = adapter.id

    def products(self, rows: int) -> SlotProducts:
        """The products of a step of `rows` rows, reading each row's slot from `row_slots` (tensor ops
        alone: what a CUDA graph captures)."""
        return SlotProducts(self, rows)


class SlotProducts:
    """One step's LoRA products over the fixed slots (`LoraProducts`, engine/lora/batch.py)."""

    def __init__(self, slots: LoraSlots, rows: int) -> None:
        self._slots = slots
        row_slots = slots.row_slots[:rows]
        self._mask = (row_slots[:, None] == slots.column_slots[None, :]).to(slots.dtype)  # [rows, slots x rank]

    def apply(self, key: str, x: torch.Tensor, out: torch.Tensor) -> None:
        group = self._slots.groups.get(key)
        if group is None:
            return
        rows = x.shape[0]
        low = torch.mm(x.to(group.a.dtype), group.a.t()).view(rows, len(group.b), -1)
        low.mul_(self._mask[:, None, :])
        for part, (columns, b) in enumerate(group.b):
            target = out[:, columns]
            target.addmm_(low[:, part], b.t().to(target.dtype))
