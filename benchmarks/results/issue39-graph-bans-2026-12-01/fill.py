"""Issue #39: the host's fill of a sampled decode graph's buffers (`GraphSampler.fill`), 128 rows of a graph of
256, SmolLM2's vocabulary, the median of 51 fills; run with the tree on ``PYTHONPATH`` (a worktree of
``259f707`` for the fill before the ban's buffers, whose rows carry no ids):

    for tree in /tmp/wt0 .; do PYTHONPATH=$tree python benchmarks/results/issue39-graph-bans-2026-12-01/fill.py; done

(`fill.txt`: three such pairs, 21:21 UTC; the machine is shared, and the second and third pairs ran beside a
neighbour's load.)
"""

from __future__ import annotations

import statistics
import time

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner import graph_sampling
from lmiserve.engine.runner.graph_sampling import GraphSampler

torch.set_num_threads(1)
BANS = len(graph_sampling.GraphRow.__args__) == 5  # (the tree of the change: rows carry their ids)
KINDS = {
    "greedy, min_tokens": SamplingParams(min_new_tokens=128),
    "sampled T 0.7, min_tokens": SamplingParams(do_sample=True, temperature=0.7, min_new_tokens=128),
    "sampled T 0.7": SamplingParams(do_sample=True, temperature=0.7),
}
sampler = GraphSampler(256, 49152, torch.device("cpu"), pin=False)
out = {}
for name, params in KINDS.items():
    banned = [0, 2] if params.min_new_tokens else []
    rows = [(params, n, 21, None, banned) if BANS else (params, n, 21, None) for n in range(128)]
    times = []
    for _ in range(51):
        start = time.perf_counter()
        sampler.fill(rows, 128)
        times.append(time.perf_counter() - start)
    out[name] = round(statistics.median(times) * 1e3, 3)
print("with the ban's buffers" if BANS else "before (259f707)", "ms:", out)
