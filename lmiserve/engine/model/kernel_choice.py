"""Choosing a Triton kernel's tile by measuring it on the GPU that serves (issue #39): a tile tuned on one
GPU can lose on another, and a tile a GPU or Triton miscompiles must never serve. Shared by the quantized
products of few rows (`fp8_gemv`) and the 4-bit products (`int4_triton`).

`pick` runs each candidate on a probe, refuses the ones whose result is more than `TOLERANCE` off the
reference product (logged), times the others (and the product they would replace, `baseline`) as they will
run: decode rows' products with `time_gpu` (on CUDA in a CUDA graph, as the decode graphs replay them: timed
eagerly, a product of a few rows measures its launches, the same for every tile, and not the GPU's time that
tells them apart), a prompt's with `time_call` (eager steps, launches included), and returns the fastest; it
logs the choice once. The callers keep the choice per weight shape and row
bucket, measured outside CUDA-graph captures (the decode graphs' eager warm-up before each capture is such a
call, so the graphs record the choice).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = [
    "DECODE_ROWS",
    "REPEATS",
    "TOLERANCE",
    "Tile",
    "pick",
    "split_k_product",
    "switch",
    "time_call",
    "time_gpu",
    "time_in_graph",
]

TOLERANCE = 2e-2  # max |candidate - reference| / max |reference| (bf16's rounding is ~4e-3)
REPEATS = 20  # calls timed per candidate on CUDA (after one untimed: Triton compiles)
DECODE_ROWS = 16  # the largest row bucket timed as the decode graphs run it (`pick`); more rows: a prompt's

C = TypeVar("C")


@dataclass(frozen=True)
class Tile:
    """One tile of a few-rows product kernel: `use_dot` (tensor cores, 16 rows or more a tile) or per-row
    sums (1-4 rows), `block_m` rows x `block_n` outputs, `block_k` inputs a step; `split_k`: the inputs split
    between that many programs, their sums added after (more programs for a long K and few outputs), by two
    kernels after the product's or, `adds_in_kernel`, by the last of a tile's programs (`split_k_kernel`: one
    kernel); `late_sum` (per-row sums, the fp8 kernel): each input's products kept over the loop and summed over
    the inputs once at the end, not a step at a time; `prefetch` (per-row sums, the fp8 kernel): each step's loads
    issued before the step before it is computed (two tiles in flight a program)."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    adds_in_kernel: bool = False
    late_sum: bool = False
    prefetch: bool = False

    def fitted(self, group: int) -> Tile:
        """This tile with its `block_k` halved until it divides `group` (a multiple of 32: AWQ/GPTQ groups)."""
        block_k = self.block_k
        while group % block_k:
            block_k //= 2
        return self if block_k == self.block_k else dataclasses.replace(self, block_k=block_k)

    def __str__(self) -> str:
        kind = "dot" if self.use_dot else "late-sum" if self.late_sum else "sum"
        kind += " prefetch" if self.prefetch else ""
        split = f" split={self.split_k}{' in-kernel' if self.adds_in_kernel else ''}" if self.split_k > 1 else ""
        tile = f"{self.block_m}x{self.block_n}x{self.block_k}"
        return f"{kind} {tile}{split} warps={self.num_warps} stages={self.num_stages}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int], int, int], None]


def split_k_product(tile: Tile, x: torch.Tensor, weight: torch.Tensor, launch: Launch) -> torch.Tensor:
    """``[rows, outputs]`` in `x`'s dtype (`x` ``[rows, inputs]``, `weight` ``[outputs, ...]``) from one launch
    of a few-rows kernel with the `tile`: ``launch(y, parts, counters, grid, k_share, split)`` computes over the
    `grid` (output tiles, row tiles, K splits), each program of the third axis summing `k_share` inputs (a
    multiple of `block_k`), its sums stored as `split_k_kernel.store_sums` does by `split`: 0 (unsplit) into
    `y`; split, each split's scaled fp32 sums into its slice of `parts` ``[splits, rows, outputs]``, added in one
    fixed order (the same bits every run) here after the kernel (1) or by the tile's last program into `y` (2,
    `Tile.adds_in_kernel`, with the weight's `counters`: outside a CUDA-graph capture or once the weight has
    them, else 1)."""
    rows, inputs = x.shape
    outputs = weight.shape[0]
    k_share = _cdiv(_cdiv(inputs, tile.split_k), tile.block_k) * tile.block_k
    splits = _cdiv(inputs, k_share)
    grid = (_cdiv(outputs, tile.block_n), _cdiv(rows, tile.block_m), splits)
    y = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    if splits == 1:
        launch(y, y, y, grid, k_share, 0)
        return y
    parts = torch.empty(splits, rows, outputs, dtype=torch.float32, device=x.device)
    counters = _counters(weight, grid[0] * grid[1]) if tile.adds_in_kernel else None
    if counters is None:
        launch(y, parts, parts, grid, k_share, 1)
        return parts.sum(0).to(x.dtype)
    launch(y, parts, counters, grid, k_share, 2)
    return y


# each weight's tile counters (int32, 0 between products) for the splits added in the kernel, kept for as long as
# the process runs: a captured CUDA graph holds their address. Per weight (its device and address), so that two
# products on two streams (two models on one GPU) never share one
_tile_counters: dict[tuple[torch.device, int], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # counters a weight outgrew, kept: a graph captured before may still use them


def _counters(weight: torch.Tensor, tiles: int) -> torch.Tensor | None:
    """`weight`'s counters, at least `tiles` of them, allocated (zeros) outside a CUDA-graph capture; None where
    they are missing inside one (an allocation there would belong to the graph's memory)."""
    key = (weight.device, weight.data_ptr())
    have = _tile_counters.get(key)
    if have is not None and have.numel() >= tiles:
        return have
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if have is not None:
        _outgrown.append(have)
    made = _tile_counters[key] = torch.zeros(max(tiles, 64), dtype=torch.int32, device=weight.device)
    return made


def time_call(call: Callable[[], object], device: torch.device) -> float:
    """Seconds a call: `REPEATS` in a row between CUDA events after one untimed (the GPU's time where the
    GPU is the bottleneck, each call's launches included where it is not); on a CPU one call, timed."""
    call()
    if device.type != "cuda":
        started = time.perf_counter()
        call()
        return time.perf_counter() - started
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(REPEATS):
        call()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / REPEATS


def time_in_graph(call: Callable[[], object], device: torch.device, repeats: int = REPEATS, replays: int = 3) -> float:
    """Seconds one call takes on CUDA as the decode graphs run it (the GPU's time alone: no launches, no host):
    `repeats` calls captured in one CUDA graph, after 3 on a side stream (Triton compiles, the allocator settles),
    the graph replayed once, then `replays` times between events. Raises where the capture fails."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (as the decode graphs capture)
        for _ in range(repeats):
            call()
    graph.replay()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / (replays * repeats)


def time_gpu(call: Callable[[], object], device: torch.device) -> float:
    """Seconds one call takes on the device's own time: on CUDA in a CUDA graph (`time_in_graph`: raises where
    the call cannot be captured, which a decode graph could not hold either); elsewhere (Triton's interpreter in
    the tests) `time_call`."""
    if device.type != "cuda":
        return time_call(call, device)
    return time_in_graph(call, device)


def switch(variable: str) -> bool | None:
    """A kernel's switch in the environment: ``1`` on, ``0`` off, unset (or ``auto``) None: the kernel's own
    rule decides. Any other value stops the start with one line (never silently taken as unset)."""
    value = os.environ.get(variable, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("1", "0"):
        raise ValueError(f"{variable}={value!r}: expected 1 (on), 0 (off), or unset (auto)")
    return value == "1"


def pick(
    log: logging.Logger,
    what: str,
    shape: tuple[int, int, int],
    candidates: Iterable[C],
    run: Callable[[C], torch.Tensor],
    want: torch.Tensor | Callable[[C], torch.Tensor],
    device: torch.device,
    baseline: tuple[str, Callable[[], object] | None],
) -> C | None:
    """The fastest of `candidates` (`run(candidate)` computes the probe's product) whose result is within
    `TOLERANCE` of `want` (or of ``want(candidate)``: a candidate whose numbers differ by design, as one that
    quantizes the activations, is checked against the same arithmetic in fp32), or None where `baseline` (``(its
    name, a call)``) is faster, or no candidate passes. `shape` is ``(outputs, inputs, rows)`` for the log lines,
    which `log` writes; a baseline whose call is None is only the fallback (too slow to compete), never timed. Up to
    `DECODE_ROWS` rows the product runs in the decode graphs, so it is timed as they replay it (`time_gpu`); more
    rows as eager steps run it (`time_call`: a prompt's rows, their launches included)."""
    outputs, inputs, rows = shape
    timer = time_gpu if rows <= DECODE_ROWS else time_call
    times: dict[C | None, float] = {}
    name, call = baseline
    if call is not None:
        try:
            times[None] = timer(call, device)
        except Exception as exc:  # noqa: BLE001 - this torch or GPU refuses the baseline here: the kernel alone
            log.debug("the %s product through %s failed: %s", what, name, exc)
    refused: list[str] = []
    for candidate in candidates:
        try:
            got = run(candidate)
            reference = want if isinstance(want, torch.Tensor) else want(candidate)
            gap = (got.float() - reference).abs().max().item() / (reference.abs().max().item() or 1.0)
            if not gap <= TOLERANCE:  # (NaN too)
                refused.append(f"{candidate}: off by {gap:.3g}")
                continue
            times[candidate] = timer(functools.partial(run, candidate), device)
        except Exception as exc:  # noqa: BLE001 - a tile this GPU or Triton cannot compile: the others compete
            refused.append(f"{candidate}: {type(exc).__name__}: {str(exc)[:120]}")
    if refused:
        log.warning(
            "%s candidates refused for [%d x %d] at %d rows: %s", what, outputs, inputs, rows, "; ".join(refused)
        )
    if not times:
        return None
    best = min(times, key=times.__getitem__)
    fastest = min((c for c in times if c is not None), key=times.__getitem__, default=None)
    kernel = f"{fastest} {1e6 * times[fastest]:.1f} us" if fastest is not None else "refused"
    other = f"{1e6 * times[None]:.1f} us" if None in times else ("failed" if call is not None else "not timed")
    runs = name if best is None else "the Triton kernel" if isinstance(best, Tile) else str(best)
    log.info(
        "%s products [%d x %d] at %d row(s) run on %s (the fastest candidate: %s; %s: %s)",
        what, outputs, inputs, rows, runs, kernel, name, other,
    )  # fmt: skip
    return best
