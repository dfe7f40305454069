"""Overlap scheduling over tensor-parallel ranks (issue #39 item 1), in one run, in turns: the engine over `--degree`
workers with `async_scheduling` on, each step sent to the ranks before the one before it is answered ("pipelined":
`TensorParallelExecutor.launch`, the ranks launching a step that comes while the one before runs behind it:
engine/executors/tp_steps.py) against each step a full round trip before the next is sent ("round trip", how every
tensor-parallel step ran before).

    python benchmarks/tp_overlap.py [--model-id DIR] [-o KEY=VALUE ...] [--device cpu|cuda] [--degree 2]
                                    [--rows 1,8,32] [--new-tokens 64] [--turns 3] [--out DIR]

One engine serves every run (its workers start once): for each row count, a warm-up, then `--turns` pairs of runs
in turns (round trip, pipelined), `rows` greedy streams at once (`ignore_eos`). The figure is the decode rate once
every stream has its first token (benchmarks/overlap_scheduling.py's); the ratio is pipelined / round trip of the
turns' medians. Every run's tokens must equal the first run's, and the batches sent ahead of an answer are counted
(`TensorParallelExecutor.sent_ahead`). Without --model-id: the tests' tiny Llama, where the host is most of a step.
On a machine with one GPU `--degree 1` still runs the workers' path (a spawned worker, NCCL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


async def measure(engine: Any, rows_list: list[int], new_tokens: int, turns: int) -> list[dict[str, Any]]:
    """Every row count's runs on the started `engine`, in turns."""
    from overlap_scheduling import streams  # (benchmarks/ is the script's folder: on sys.path)

    from lmiserve.engine.core.step import Launched

    executor = engine.executor

    def round_trip(batch: Any) -> Launched:
        return Launched(executor.execute(batch))

    results = []
    for rows in rows_list:
        await streams(engine, rows, 8)  # warm-up: shapes, caches
        runs = []
        for _ in range(turns):
            for pipelined in (False, True):
                if pipelined:
                    executor.__dict__.pop("launch", None)
                else:
                    executor.launch = round_trip
                sent_before, steps_before = executor.sent_ahead, engine.steps
                tokens, rate = await streams(engine, rows, new_tokens)
                runs.append(
                    {
                        "pipelined": pipelined,
                        "tokens_per_s": rate,
                        "steps": engine.steps - steps_before,
                        "sent_ahead": executor.sent_ahead - sent_before,
                        "tokens": tokens,
                    }
                )
        executor.__dict__.pop("launch", None)
        off = statistics.median(r["tokens_per_s"] for r in runs if not r["pipelined"])
        on = statistics.median(r["tokens_per_s"] for r in runs if r["pipelined"])
        result = {
            "rows": rows,
            "round_trip_tokens_per_s": round(off, 1),
            "pipelined_tokens_per_s": round(on, 1),
            "ratio": round(on / off, 3),
            "same_tokens": all(r["tokens"] == runs[0]["tokens"] for r in runs),
            "sent_ahead_share": round(
                statistics.median(r["sent_ahead"] / max(r["steps"], 1) for r in runs if r["pipelined"]), 3
            ),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        }
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}), flush=True)
        results.append(result)
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| rows | round trip tok/s | pipelined tok/s | ratio | steps sent ahead of an answer | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} | {r['round_trip_tokens_per_s']:.1f} | {r['pipelined_tokens_per_s']:.1f} | "
            f"{r['ratio']:.2f}x | {100 * r['sent_ahead_share']:.0f} % | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="a model directory (default: the tests' tiny Llama)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3, help="round trip / pipelined pairs per row count")
    parser.add_argument("--out", type=Path, help="a directory for summary.json and summary.md")
    args = parser.parse_args()

    import torch

    from lmiserve.config import Settings
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    rows_list = [int(r) for r in args.rows.split(",")]
    load_before = os.getloadavg()
    with ExitStack() as stack:
        model_dir = args.model_id
        if model_dir is None:
            from helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"))
        options = dict(item.split("=", 1) for item in args.options)
        settings = Settings.from_options(
            {
                "model_id": model_dir,
                "device": args.device,
                "tensor_parallel_degree": str(args.degree),
                "async_scheduling": "true",
                "max_rolling_batch_size": str(max(rows_list)),
                **options,
            }
        )
        shell = load_model_shell(model_dir, dtype=settings.dtype, device=args.device)
        engine = build_tensor_parallel_engine(shell, settings, args.degree)

        async def run() -> list[dict[str, Any]]:
            engine.start()
            try:
                return await measure(engine, rows_list, args.new_tokens, args.turns)
            finally:
                await engine.stop()

        results = asyncio.run(run())
    from machine import cpu_model
    from overlap_scheduling import write_summary

    env = {
        "cpu": cpu_model(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "device": args.device,
        "degree": args.degree,
        "model": args.model_id or "tiny Llama (tests)",
        "options": options,
        "torch": torch.__version__,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
    }
    write_summary(args.out, env, table(results), results)


if __name__ == "__main__":
    main()
