"""Launches and host waits of one step's sampling of 128 sampled rows on a GPU's path (issue #39), the rows
drawn by their generators (`sampling._draw`: an exponential fill a row) against the seeded draw kernel
(engine/runner/seeded_draw.py). Counted on this CPU: every aten op `sample_rows` dispatches (on a GPU each one
with a kernel is a launch), with the kernel itself replaced by a stub counted as one launch (under Triton's
interpreter it would add the interpreter's own tensor ops, which a GPU does not run).

    PYTHONPATH=. python benchmarks/results/issue39-seeded-draw-2026-12-01/count_draw.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from helpers.capture_hazards import Hazards, watch  # noqa: E402
from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import sampling, seeded_draw  # noqa: E402
from lmiserve.engine.runner.sampling import sample_rows, sampler_row  # noqa: E402

ROWS = 128
KINDS = {
    "temperature 0.7": {"do_sample": True, "temperature": 0.7},
    "top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    "top_k 50, top_p 0.9, penalties": {"do_sample": True, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.1},
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Launch:
    """The kernel's launch, as `seeded_draw._kernel()[grid](...)` makes it: its outputs filled (token 0 of
    each part, valid rows) outside the count."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(
            probs: Any, seeds: Any, counts: Any, best: Any, where: Any, total: Any, least: Any, *rest: Any, **kw: Any
        ) -> None:
            with _disable_current_modes():
                best.fill_(1.0), where.zero_(), total.fill_(1.0), least.zero_()

        return launch


def main() -> None:
    sampling._at_once = lambda device: True  # the GPU's path: the rows at once
    print("| 128 rows, each | draw | waits a step | aten ops a step (the kernel one) | exponential fills | ops a row |")
    print("|---|---|---|---|---|---|")
    for name, kind in KINDS.items():
        for kernel in (False, True):
            seeded_draw.usable = lambda device, kernel=kernel: kernel  # type: ignore[misc]
            seeded_draw._kernel = lambda: _Launch()  # type: ignore[assignment]

            def rows(kind: dict[str, Any] = kind) -> list[Any]:
                params = SamplingParams(**kind)
                return [sampler_row(params, [1, 2], [3] * (i % 5), [0], seed=i, generator=None) for i in range(ROWS)]

            logits = torch.randn(ROWS, 8192, generator=torch.Generator().manual_seed(0)) * 3
            hazards = Hazards()
            watch(hazards, sample_rows, logits, rows())
            count = _Count()
            with torch.inference_mode(), count:
                sample_rows(logits, rows())
            launches = sum(count.ops.values()) + kernel
            fills = count.ops["aten.exponential_.default"]
            print(
                f"| {name} | {'one kernel' if kernel else 'generators'} | {len(hazards.syncs)} | {launches} | "
                f"{fills} | {launches / ROWS:.2f} |"
            )


if __name__ == "__main__":
    main()
