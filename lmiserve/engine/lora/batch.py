"""One step's LoRA products, batched by adapter as punica/S-LoRA's segmented products do, shaped for few
large calls instead of one per adapter (`LoraBatch`): for a group of linears that read the same input (the
fast path's fused q/k/v, gate/up, or one linear of transformers' forward), every active adapter's ``A``
rows are stacked, so one product ``x @ A_all^T`` gives every token every adapter's low-rank activations; a
0/1 mask keeps each token's own adapter's columns; then one product a linear with the stacked ``s B`` adds
the deltas into the base output. The wasted work (each token's product with the other adapters' ``A``) is
rank x adapters x in per token, a few percent of the base product for the usual ranks; the number of calls
does not grow with the number of adapters. The stacks of one set of adapters are built once and reused
while the set is active (`StackCache`). The adapters themselves: engine/lora/adapters.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine import host_copy
from lmiserve.engine.lora import kernels as lora_kernels
from lmiserve.engine.lora.adapters import LoraAdapter

__all__ = ["LoraBatch", "LoraGroup", "LoraProducts", "StackCache"]


# ---- one step's products -------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraGroup:
    """Linears that read one input and whose outputs sit side by side in one output (the fast path's
    fused q/k/v: three parts; a linear of transformers' forward: one): each part's module path and
    its output columns."""

    key: str
    parts: tuple[tuple[str, int, int], ...]  # (module path, first output column, end)
    inputs: int = 0  # the width of the input the parts read (0: not said; the fixed slots need it)


class LoraProducts(Protocol):
    """What a forward asks of a step's adapters (`LoraBatch`, or engine/lora/slots.py's fixed slots)."""

    def apply(self, key: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the adapters' deltas for group `key` to `out` (``[rows, out]``, in place) from its input `x`."""
        ...


@dataclass
class _Part:
    """One module of a group, for a set of adapters: its output columns, its columns of the stacked
    activations, where each adapter's are among them (``(first, end)`` by adapter index; equal: it does
    not adapt this module), and the adapters' scaled B matrices side by side (``[out, sum of ranks]``)."""

    out: slice
    cols: slice
    segments: list[tuple[int, int]]
    b: torch.Tensor


@dataclass
class _Stack:
    """A group's stacked matrices for one set of adapters: every A row (``[sum of ranks, in]``, module
    after module, adapter after adapter), the adapter (index in the set) each row belongs to, the parts,
    and (CPU fp32) the compiled kernels' arguments."""

    a: torch.Tensor
    owner: tuple[int, ...]
    parts: list[_Part]
    kernel: _KernelArgs | None = None


@dataclass
class _KernelArgs:
    """`lora_kernels.shrink`/`expand`'s view of a `_Stack`: A and the adapter of each of its rows; B
    transposed, a row a column of A over the group's outputs (zero outside its part's), each part's
    per-adapter column ranges, and the expand's tasks."""

    a: npt.NDArray[np.float32]
    col_owner: npt.NDArray[np.int64]
    bt: npt.NDArray[np.float32]
    seg_start: npt.NDArray[np.int64]
    seg_end: npt.NDArray[np.int64]
    tasks: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]

    @staticmethod
    def of(stack: _Stack, adapters: int) -> _KernelArgs:
        width = max(part.out.stop for part in stack.parts)
        bt = np.zeros((len(stack.owner), width), dtype=np.float32)
        seg_start = np.zeros((len(stack.parts), adapters), dtype=np.int64)
        seg_end = np.zeros((len(stack.parts), adapters), dtype=np.int64)
        for p, part in enumerate(stack.parts):
            bt[part.cols, part.out] = part.b.t().cpu().numpy()
            for index, (start, end) in enumerate(part.segments):
                seg_start[p, index], seg_end[p, index] = start, end
        tasks = lora_kernels.blocks([(part.out.start, part.out.stop) for part in stack.parts])
        a = np.ascontiguousarray(stack.a.cpu().numpy())
        return _KernelArgs(a, np.array(stack.owner, dtype=np.int64), bt, seg_start, seg_end, tasks)


def _stack(group: LoraGroup, adapters: Sequence[LoraAdapter], kernels: bool) -> _Stack | None:
    """The group's matrices for `adapters` (None when none of them adapts any of its modules)."""
    a_rows: list[torch.Tensor] = []
    owner: list[int] = []
    parts: list[_Part] = []
    for path, first, end in group.parts:
        col = len(owner)
        bs: list[torch.Tensor] = []
        segments = []
        for index, adapter in enumerate(adapters):
            pair = adapter.modules.get(path)
            start = len(owner)
            if pair is not None:
                a, b = pair
                a_rows.append(a)
                bs.append(b)
                owner.extend([index] * a.shape[0])
            segments.append((start, len(owner)))
        if bs:
            b_all = bs[0] if len(bs) == 1 else torch.cat(bs, dim=1)
            parts.append(_Part(slice(first, end), slice(col, len(owner)), segments, b_all.contiguous()))
    if not parts:
        return None
    stack = _Stack(a_rows[0] if len(a_rows) == 1 else torch.cat(a_rows, dim=0), tuple(owner), parts)
    if kernels:
        stack.kernel = _KernelArgs.of(stack, len(adapters))
    return stack


class StackCache:
    """Each group's stacks for the last few sets of adapters (built on a set's first step)."""

    def __init__(self, groups: Iterable[LoraGroup], keep: int = 4) -> None:
        self.groups = {group.key: group for group in groups}
        self._sets: OrderedDict[tuple[int, ...], dict[str, _Stack | None]] = OrderedDict()
        self._keep = keep

    def add_group(self, group: LoraGroup) -> None:
        if group.key not in self.groups:
            self.groups[group.key] = group
            self._sets.clear()

    def stacks(self, adapters: Sequence[LoraAdapter], kernels: bool) -> dict[str, _Stack | None]:
        key = (*(adapter.id for adapter in adapters), kernels)
        found = self._sets.get(key)
        if found is None:
            found = {name: _stack(group, adapters, kernels) for name, group in self.groups.items()}
            self._sets[key] = found
            while len(self._sets) > self._keep:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(key)
        return found


class LoraBatch:
    """The adapters of one step: which adapter each token row uses (`owners`: an index into `adapters`,
    -1 for the base model; rows past the list, such as padding, use none) and the products that add their
    deltas to a group's output (`apply`).

    Three ways, by where and how many rows: up to `lora_kernels.MAX_ROWS` rows on CPU fp32 the compiled
    kernels (each adapter's weights read once, each token its own adapter's products); more rows (a
    prompt chunk), each adapter's rows gathered and multiplied by its own matrices; on a GPU (or another
    dtype) the stacked products of every token with every adapter, masked: a few large calls whatever the
    number of adapters."""

    def __init__(
        self,
        adapters: Sequence[LoraAdapter],
        owners: Sequence[int],
        cache: StackCache,
        device: torch.device,
        dtype: torch.dtype,
        kernels: bool = True,
    ) -> None:
        """`kernels`: False keeps the torch products where the compiled kernels would apply."""
        self.adapters = list(adapters)
        self._owners = list(owners)
        self._device, self._dtype = device, dtype
        self._cpu = device.type == "cpu"
        self._kernels = kernels and lora_kernels.available(dtype, device)
        self._stacks = cache.stacks(self.adapters, self._kernels)
        self._rows = -1
        self._owner_t: torch.Tensor | None = None
        self._owner_np: npt.NDArray[np.int64] | None = None
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._segments: list[tuple[int, torch.Tensor]] = []  # (adapter index, its rows), for gathering
        # every row uses the one adapter: no mask, no gathering
        self._uniform = len(self.adapters) == 1 and all(o == 0 for o in owners)

    @staticmethod
    def of(
        row_adapters: Sequence[LoraAdapter | None],
        cache: StackCache,
        device: torch.device,
        dtype: torch.dtype,
        kernels: bool = True,
    ) -> LoraBatch | None:
        """The batch of these token rows' adapters (None: no row uses one). The adapters are ordered by id,
        so a set of adapters has one stack whatever the order of its rows (rows move between steps as
        requests come and go; each new order would build the stacks again)."""
        unique = {adapter.id: adapter for adapter in row_adapters if adapter is not None}
        if not unique:
            return None
        adapters = [unique[key] for key in sorted(unique)]
        index = {adapter.id: at for at, adapter in enumerate(adapters)}
        owners = [-1 if adapter is None else index[adapter.id] for adapter in row_adapters]
        return LoraBatch(adapters, owners, cache, device, dtype, kernels)

    @property
    def owners(self) -> list[int]:
        """Each token row's adapter (an index into `adapters`; -1: the base model)."""
        return self._owners

    def _for_rows(self, rows: int) -> None:
        """The owners of `rows` token rows (padding: none), made once a step."""
        if rows == self._rows:
            return
        padded = self._owners[:rows] + [-1] * (rows - len(self._owners))
        self._rows, self._masks = rows, {}
        self._owner_np = np.array(padded, dtype=np.int64)
        self._owner_t = host_copy.to_device(self._owner_np, self._device)
        self._segments = []  # made by the first gathered product of the step

    def _mask(self, owner: tuple[int, ...]) -> torch.Tensor:
        mask = self._masks.get(owner)
        if mask is None:
            assert self._owner_t is not None
            columns = host_copy.to_device(owner, self._device)
            mask = self._masks[owner] = (self._owner_t[:, None] == columns[None, :]).to(self._dtype)
        return mask

    def apply(self, key: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the adapters' deltas for group `key` to `out` (``[rows, out]``, in place) from its input
        `x` (``[rows, in]``)."""
        stack = self._stacks.get(key)
        if stack is None:
            return
        rows = x.shape[0]
        self._for_rows(rows)
        if stack.kernel is not None and rows <= lora_kernels.MAX_ROWS:
            args = stack.kernel
            assert self._owner_np is not None
            low = lora_kernels.shrink(x, args.a, args.col_owner, self._owner_np)
            lora_kernels.expand(low, self._owner_np, args.bt, args.seg_start, args.seg_end, args.tasks, out)
        elif self._cpu and not self._uniform:
            self._apply_gathered(stack, x, out)
        else:
            self._apply_stacked(stack, x, out)

    def _apply_stacked(self, stack: _Stack, x: torch.Tensor, out: torch.Tensor) -> None:
        """Every token times every adapter's A, masked to its own adapter's columns, times the B's."""
        low = torch.mm(x.to(stack.a.dtype), stack.a.t())
        if not self._uniform:  # rows past the list are padding: dropped, whatever they add
            low.mul_(self._mask(stack.owner))
        for part in stack.parts:  # one product a part, whatever the adapters (masked columns are zero)
            target = out[:, part.out]
            target.addmm_(low[:, part.cols], part.b.t().to(target.dtype))

    def _apply_gathered(self, stack: _Stack, x: torch.Tensor, out: torch.Tensor) -> None:
        """Each adapter's rows times its own matrices only (no product with another adapter's)."""
        if not self._segments:
            assert self._owner_t is not None
            owners = self._owner_t
            self._segments = [(i, torch.nonzero(owners == i).flatten()) for i in range(len(self.adapters))]
        for index, rows in self._segments:
            if rows.numel() == 0:
                continue
            picked = x.index_select(0, rows).to(stack.a.dtype)
            for part in stack.parts:
                first, end = part.segments[index]
                if first == end:
                    continue
                low = torch.mm(picked, stack.a[first:end].t())
                cols = slice(first - part.cols.start, end - part.cols.start)
                delta = torch.mm(low, part.b[:, cols].t())
                out[:, part.out].index_add_(0, rows, delta.to(out.dtype))
