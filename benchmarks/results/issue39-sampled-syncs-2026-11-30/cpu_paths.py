"""On a CPU, a step's sampled rows each alone (the CPU's path) against all at once (a GPU's path), on one
thread, in turns in one process: `sample_rows` of 128 rows of 49,152 tokens, ms a step, the median of
--repeat (issue #39, 2026-11-30).

    PYTHONPATH=. python benchmarks/results/issue39-sampled-syncs-2026-11-30/cpu_paths.py [--repeat 5]
"""

import argparse
import statistics
import time

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner import sampling
from lmiserve.engine.runner.sampling import sample_rows, sampler_row

parser = argparse.ArgumentParser()
parser.add_argument("--repeat", type=int, default=5)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()
torch.set_num_threads(args.threads)
KINDS = {
    "temperature 0.7": {"do_sample": True, "temperature": 0.7},
    "top_k 50, top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9},
}
logits = torch.randn(128, 49152, generator=torch.Generator().manual_seed(0)) * 3
print(f"| rows (128, each), {args.threads} thread(s) | each alone, ms | all at once, ms |")
print("|---|---|---|")
with torch.inference_mode():
    for name, kind in KINDS.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeat):
            for at_once in (False, True):
                sampling._at_once = lambda device, at_once=at_once: at_once
                rows = [
                    sampler_row(SamplingParams(**kind), [1, 2], [3], [0], seed=i, generator=None) for i in range(128)
                ]
                start = time.perf_counter()
                sample_rows(logits, rows)
                times[at_once].append((time.perf_counter() - start) * 1000)
        print(f"| {name} | {statistics.median(times[False]):.1f} | {statistics.median(times[True]):.1f} |")
