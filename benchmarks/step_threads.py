"""One fast-forward decode step of the bundled model, timed in process: what the OpenMP wait policy and
the thread count cost, idle or beside a busy neighbour (benchmarks/README.md, "Threads").

    GOMP_SPINCOUNT=10000 .venv/bin/python benchmarks/step_threads.py [--dtype int4] [--threads N] [--rows 1]
    taskset -c 1 sh -c 'while :; do :; done' &   # a busy neighbour on one of two cores, then run again

The OpenMP variables (OMP_WAIT_POLICY, GOMP_SPINCOUNT) must be set in the environment: OpenMP reads them
when torch is imported. Prints the median step, tokens/s over 60 steps and the process's CPU per wall
second (a spinning pool shows as CPU without speed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dtype_decode import fast_forward, fast_step  # noqa: E402
from lmiserve.models import load_causal_lm, resolve_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--threads", type=int, default=None, help="torch's and numba's threads (default: as started)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.threads:
        from lmiserve.engine.cpu_threads import apply

        apply(args.threads)
    loaded = load_causal_lm(resolve_model_path(None), dtype=args.dtype, device="cpu")
    fast, _ = fast_forward(loaded, args.rows, "static")
    step = fast_step(fast, args.rows)
    with torch.inference_mode():
        for _ in range(5):
            step()
        times, start, cpu = [], time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    times.sort()
    spin = os.environ.get("GOMP_SPINCOUNT")
    wait = os.environ.get("OMP_WAIT_POLICY") or (f"GOMP_SPINCOUNT={spin}" if spin else "default")
    median = times[len(times) // 2] * 1e3
    print(
        f"{args.dtype} rows {args.rows} threads {torch.get_num_threads()} wait {wait}: median {median:.1f} ms, "
        f"{args.steps * args.rows / wall:.1f} tok/s, CPU/wall {cpu / wall:.2f}"
    )


if __name__ == "__main__":
    main()
