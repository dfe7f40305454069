"""The host waits, the aten ops and the CPU time of one step's sampling (`sample_rows`) of 128 rows, for
several kinds of sampled rows (issue #39: a GPU's sampled rows).

    PYTHONPATH=. python benchmarks/results/issue39-sampled-syncs-2026-11-30/count_sampling.py [--repeat 5]
        [--kinds "typical_p 0.9;typical_p 0.9, 1 row in 8"]

Waits and ops are counted on a GPU's path (the rows at once, `sampling._at_once`; at 8,192 tokens, where
`top_p` sorts as a GPU's does): waits by the capture-hazard watch (tests/helpers/capture_hazards.py), ops
as every aten op the call dispatches (on a GPU, each one with a kernel is a launch; `torch.multinomial`
counts one, and launches a dozen). Time: the median of --repeat calls at 49,152 tokens (SmolLM2's) on this
CPU, on the CPU's own path, with the engine's two threads and with one.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from helpers.capture_hazards import Hazards, watch  # noqa: E402
from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import sampling  # noqa: E402
from lmiserve.engine.runner.sampling import sample_rows, sampler_row  # noqa: E402

KINDS: dict[str, dict[str, Any]] = {
    "temperature 0.7": {"do_sample": True, "temperature": 0.7},
    "top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    "top_k 50, top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "min_p, typical_p": {"do_sample": True, "min_p": 0.05, "typical_p": 0.9},
    "penalties, sampled": {
        "do_sample": True,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.2,
    },
    "penalties, greedy": {"repetition_penalty": 1.1},
    "bias, bad words, min_new_tokens": {
        "do_sample": True,
        "logit_bias": {5: 2.0, 7: -100.0},
        "bad_words_ids": [[11], [3, 4]],
        "min_new_tokens": 8,
    },
    # (2026-12-01: `typical_p` at once on a GPU) alone, and on one row in 8 (the others at temperature 0.7)
    "typical_p 0.9": {"do_sample": True, "typical_p": 0.9},
    "typical_p 0.9, 1 row in 8": {"do_sample": True, "typical_p": 0.9, "every": 8},
}
ROWS = 128


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _rows(kind: dict[str, Any]) -> list:
    kind = dict(kind)
    every = kind.pop("every", 1)  # the kind on one row in `every`, the others at temperature 0.7
    params, other = SamplingParams(**kind), SamplingParams(do_sample=True, temperature=0.7)
    return [
        sampler_row(params if i % every == 0 else other, [1, 2, 3, 4], [3, 4, 9], [0], seed=i, generator=None)
        for i in range(ROWS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kinds", default=";".join(KINDS), help="the kinds to run, by name, separated by ;")
    args = parser.parse_args()
    names = [name for name in KINDS if name in args.kinds.split(";")]
    torch.manual_seed(0)
    print("| rows (128, each) | waits a step | aten ops a row | ms a step, 2 threads | ms a step, 1 thread |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name in names:
            kind = KINDS[name]
            hazards, count = Hazards(), _Count()
            small = torch.randn(ROWS, 8192) * 3
            cpu_path = getattr(sampling, "_at_once", None)  # (before it: one path)
            if cpu_path is not None:
                sampling._at_once = lambda device: True
            watch(hazards, sample_rows, small, _rows(kind))
            with count:
                sample_rows(small, _rows(kind))
            if cpu_path is not None:
                sampling._at_once = cpu_path
            waits = collections.Counter(what for what, _ in hazards.syncs)
            logits = torch.randn(ROWS, 49152) * 3
            times = []
            for threads in (2, 1):
                torch.set_num_threads(threads)
                runs = []
                for _ in range(args.repeat):
                    rows = _rows(kind)
                    start = time.perf_counter()
                    sample_rows(logits, rows)
                    runs.append((time.perf_counter() - start) * 1000)
                times.append(statistics.median(runs))
            torch.set_num_threads(2)
            listed = ", ".join(f"{what} {n}" for what, n in sorted(waits.items()))
            cells = [
                name,
                f"{sum(waits.values())} ({listed})",
                f"{count.ops / ROWS:.1f}",
                f"{times[0]:.1f}",
                f"{times[1]:.1f}",
            ]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
