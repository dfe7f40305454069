"""Issue #39: what a decode graph's pick costs by kind (greedy, sampled without top_k and top_p, sampled with
them), and what the decode graphs' outputs kept in their memory pool before and after they shared one buffer.

    PYTHONPATH=. python benchmarks/results/issue39-graph-kinds-2026-12-01/graph_kinds.py [--rows 128] [--vocab 128256]

1. Each kind's pick (runner/graph_sampling.py `GraphSampler.pick`, `sampling.greedy_pick`) on a CPU, one
   thread, over random logits: the aten ops it dispatches, the ones among them that sort or select
   (`sort`, `topk`), the peak bytes of the tensors it holds at once (a dispatch-mode tally of the storages
   it makes, freed when their tensors go: the graphs' pool keeps the largest graph's), and its CPU time
   (the median of 5). The draw kernel is Triton's (the GPU's): here a stand-in of one op, as in
   issue39-graph-sampling-2026-12-01.
2. Arithmetic, not a measurement: the bytes the captured graphs' own outputs kept in the pool before this
   change (every graph of every size kept its float32 logits: the sum of the capture sizes' rows, a kind of
   graph each), and the one output buffer after, for a 128k vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from machine import run_facts  # noqa: E402

from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.attention.cuda_graphs import capture_sizes  # noqa: E402
from lmiserve.engine.runner import seeded_draw  # noqa: E402
from lmiserve.engine.runner.graph_sampling import GraphSampler  # noqa: E402
from lmiserve.engine.runner.sampling import greedy_pick  # noqa: E402


class Tally(TorchDispatchMode):
    """The ops dispatched and the peak bytes of the storages they made that are alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.__name__.split(".")[0])
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._freed, key, size)
        return out

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


def picks(rows: int, vocab: int) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    sampler = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=1)
    sampler.fill([(params, 1, 0, None, ())] * rows, rows)
    kinds = {
        "greedy": lambda: greedy_pick(logits),
        "sampled (no top_k, top_p, min_p)": lambda: sampler.pick(logits, filtered=False),
        "sampled-filtered": lambda: sampler.pick(logits, filtered=True),
    }
    return {name: measured(call, rows * vocab, 1) for name, call in kinds.items()}


def measured(call: Callable[[], object], logits: int, digits: int) -> dict:
    """`call` run once, then tallied, then timed: its aten ops, the sorts and top-ks among them, the peak
    bytes it holds at once over `logits` logits, and its CPU time (the median of 5, to `digits` places)."""
    call()
    tally = Tally()
    with tally:
        call()
    times = []
    for _ in range(5):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return {
        "aten_ops": len(tally.ops),
        "sort_or_topk": sorted(op for op in tally.ops if op in ("sort", "topk")),
        "peak_bytes_a_logit": round(tally.peak / logits, 1),
        "cpu_ms": round(statistics.median(times) * 1e3, digits),
    }


def pool_outputs(vocab: int) -> dict:
    out = {}
    for rows in (32, 128, 256):
        sizes = capture_sizes(rows)
        before = sum(sizes) * vocab * 4  # each graph's float32 logits (its pick: 24 B a row, left out)
        out[str(rows)] = {
            "capture_sizes": len(sizes),
            "before_gb_a_kind": round(before / 1e9, 2),
            "before_gb_greedy_and_sampled": round(2 * before / 1e9, 2),
            "after_gb_one_buffer": round(sizes[-1] * vocab * 4 / 1e9, 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeded_draw.draw_keyed = lambda probs, keys, index: (probs.argmax(-1), torch.zeros(len(probs), dtype=torch.bool))
    report = {
        **run_facts(),
        "rows": args.rows,
        "vocab": args.vocab,
        "picks": picks(args.rows, args.vocab),
        "pool_outputs_arithmetic": pool_outputs(args.vocab),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
