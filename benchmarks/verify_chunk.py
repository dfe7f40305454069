"""One forward of a draft-verification chunk against a one-token decode step, on the paged fast runner.

Speculative decoding computes a request with k drafted tokens as one chunk of k + 1 tokens (its last
token and the drafts) and keeps the logits of every position. At batch 1 a step is bound by reading the
weights, so a chunk of a few tokens should cost little more than one decode row. This script loads the
bundled model (or --model-id) in fp32 on CPU into the engine's runner as `lmiserve serve` builds it
(engine/factory.py `create_engine`, autotuned CPU kernels), then times, in alternating rounds, one
`FastLlama.forward` of:

- ``decode 1``: one decode row at position --context;
- ``chunk n``: one prefill chunk of n tokens (n in --chunks) starting at --context, all n logits kept
  (how runner/fast.py sends a row with drafts);
- ``decode 8`` / ``decode 32``: that many decode rows around --context;
- ``prefill n`` (n in --prefills): one prompt chunk of n tokens from position 0, its last logits kept.

With --compare every shape also runs as the runner did before few-row steps were tuned (the "before"
column: ``CpuGemm.few_rows`` off, so BLAS products with rows padded to 8 from 5 rows (vocabulary: from
2), and ``backends.CHUNKS_AS_DECODE_ROWS`` off, so a kernel call a short chunk and a layer), alternating
with the runner's own (the "after" column), in the same rounds; with --no-autotune both use the static
CPU defaults (the AMD EPYC's choices), else the autotuned ones. Prints medians (ms), the spread
(interquartile range as % of the median) and the ratio of each median to ``decode 1``'s of the same
kernels; --json writes the raw timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmiserve, not an installed one

from lmiserve.config.settings import Settings
from lmiserve.engine.attention import backends
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model.cpu_gemm import CpuGemm
from lmiserve.engine.model.fast_llama import StepInputs
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.models import load_causal_lm, resolve_model_path
from lmiserve.models.compose import engine_config


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        text = ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "") or (
        platform.processor()
    )


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def shapes(runner: PagedFastRunner, args: argparse.Namespace) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> one forward of that shape over the runner's pool (any blocks: no request is running)."""
    fast = runner.fast
    size, count = runner.block_size, runner.num_blocks
    context = args.context

    def table(row: int, upto: int) -> list[int]:
        return [(row * 17 + j) % count for j in range(-(-upto // size))]

    def decode(rows: int) -> Callable[[], torch.Tensor]:
        positions = [context + (i * 7) % 24 for i in range(rows)]
        tables = [table(i, p + 1) for i, p in enumerate(positions)]
        ids = [100 + i for i in range(rows)]
        return lambda: fast.forward(
            StepInputs(decode_ids=ids, decode_positions=positions, decode_tables=tables, keep=list(range(rows)))
        )

    def chunk(n: int, start: int, keep_all: bool) -> Callable[[], torch.Tensor]:
        ids = [200 + i for i in range(n)]
        keep = list(range(n)) if keep_all else [n - 1]
        prefills = [(table(40, start + n), start, ids)]
        return lambda: fast.forward(StepInputs(chunks=prefills, keep=keep))

    out: dict[str, Callable[[], torch.Tensor]] = {"decode 1": decode(1)}
    out.update({f"chunk {n}": chunk(n, context, True) for n in args.chunks})
    out.update({f"decode {rows}": decode(rows) for rows in args.batches})
    out.update({f"prefill {n}": chunk(n, 0, False) for n in args.prefills})
    return out


@torch.inference_mode()
def main(args: argparse.Namespace) -> dict:
    path = resolve_model_path(args.model_id)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    config = engine_config(Settings())
    if args.no_autotune:
        config = dataclasses.replace(config, cpu_autotune=False)
    if args.autotune_cache:
        config = dataclasses.replace(config, autotune_cache=args.autotune_cache)
    engine = create_engine(loaded, config)
    runner = engine.runner
    assert isinstance(runner, PagedFastRunner), "the bench needs the paged fast runner (a Llama-family model)"
    fast = runner.fast
    after = fast.gemm, fast.compiled_attention, True
    kernels: dict[str, tuple[CpuGemm, bool, bool]] = {"after": after}
    if args.compare:
        kernels = {"before": (after[0].with_(few_rows=0), after[1], False), "after": after}
    print(f"cpu: {cpu_model()} ({os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()})")
    print(f"kernels: {runner.kernels.describe()}")
    runs = shapes(runner, args)
    times: dict[str, dict[str, list[float]]] = {k: {name: [] for name in runs} for k in kernels}
    for run in runs.values():  # warm-up: numba compiles, RoPE table, first-touch of the blocks
        for gemm, compiled, rows in kernels.values():
            fast.use_kernels(gemm, compiled)
            backends.CHUNKS_AS_DECODE_ROWS = rows
            run()
    deadline = time.monotonic() + args.max_seconds
    rounds = 0
    for _ in range(args.rounds):
        if time.monotonic() > deadline:
            break
        for name, run in runs.items():
            if name.startswith("prefill") and rounds % args.prefill_every:
                continue
            for label, (gemm, compiled, rows) in kernels.items():
                fast.use_kernels(gemm, compiled)
                backends.CHUNKS_AS_DECODE_ROWS = rows
                start = time.perf_counter()
                run()
                times[label][name].append((time.perf_counter() - start) * 1000)
        rounds += 1
    fast.use_kernels(*after[:2])
    backends.CHUNKS_AS_DECODE_ROWS = True
    base = {label: statistics.median(times[label]["decode 1"]) for label in kernels}
    header = f"{'shape':<12}" + "".join(f"{label + ' ms':>14}{'iqr %':>7}{'x dec1':>8}" for label in kernels)
    if args.compare:
        header += f"{'after/before':>14}"
    print(f"{rounds} alternating rounds; context {args.context}; load average {os.getloadavg()[0]:.2f}")
    print(header)
    table = {}
    for name in runs:
        line = f"{name:<12}"
        row = {}
        for label in kernels:
            q1, med, q3 = quartiles(times[label][name])
            row[label] = {"median_ms": med, "iqr_pct": 100 * (q3 - q1) / med, "ratio": med / base[label]}
            line += f"{med:>14.2f}{row[label]['iqr_pct']:>7.1f}{row[label]['ratio']:>8.2f}"
        if args.compare:
            line += f"{row['after']['median_ms'] / row['before']['median_ms']:>14.2f}"
        table[name] = row
        print(line, flush=True)
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kernels": {
            label: gemm.to_dict() | {"compiled_attention": c, "chunks_as_decode_rows": r}
            for label, (gemm, c, r) in kernels.items()
        },
        "context": args.context,
        "rounds": rounds,
        "table": table,
        "times_ms": times,
        "load_average_end": list(os.getloadavg()),
    }


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--chunks", type=ints, default=[2, 3, 5, 9])
    parser.add_argument("--batches", type=ints, default=[8, 32])
    parser.add_argument("--prefills", type=ints, default=[16, 64, 512])
    parser.add_argument("--prefill-every", type=int, default=4, help="time the prefills every Nth round")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--max-seconds", type=float, default=400)
    parser.add_argument("--compare", action="store_true", help="alternate with few-row products off (before)")
    parser.add_argument("--no-autotune", action="store_true", help="the static kernel defaults")
    parser.add_argument("--autotune-cache", help="the autotune's cache file (default: the user cache's)")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    report = main(arguments)
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0)
