"""Issue #39: the peak bytes of the eager sampler's largest step as the KV pool's profile now runs it
(`sampling.sample_profile`: every row with every stage and 20 top logprobs), a logit at a time, on the GPU's
path taken on a CPU (the rows at once; the draw kernel a one-op stand-in), with graph_kinds.py's tally.

    PYTHONPATH=. python benchmarks/results/issue39-graph-kinds-2026-12-01/sampler_profile.py [--rows 32] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from lmiserve.engine.runner import sampling, seeded_draw  # noqa: E402

spec = importlib.util.spec_from_file_location("graph_kinds", Path(__file__).with_name("graph_kinds.py"))
assert spec is not None and spec.loader is not None
graph_kinds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(graph_kinds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling._at_once = lambda device: True  # the GPU's path
    seeded_draw.usable = lambda device: True
    seeded_draw.draw = lambda probs, rows, *a, **k: (probs.argmax(-1), torch.zeros(len(probs), dtype=torch.bool))
    seeded_draw.draw_keyed = lambda probs, keys, index: (probs.argmax(-1), torch.zeros(len(probs), dtype=torch.bool))
    tally = graph_kinds.Tally()
    with torch.inference_mode(), tally:
        results = sampling.sample_profile(args.rows, args.vocab, torch.device("cpu"))
    failed = [repr(r) for r in results if isinstance(r, Exception)]
    report = {
        "cpu": cpu_model(),
        "rows": args.rows,
        "vocab": args.vocab,
        "failed_rows": failed[:3],
        "aten_ops": len(tally.ops),
        "peak_bytes_a_logit": round(tally.peak / (args.rows * args.vocab), 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
