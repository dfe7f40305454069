"""The host side of a decode step replayed from a CUDA graph (issue #39 item 1): the time
`DecodeGraphs._fill` takes to put a step's rows into the graphs' buffers (token ids, positions, tile counts,
write index, block tables) and copy them to the device, at 1, 32 and 128 rows of long contexts.

    python benchmarks/graph_inputs.py [--rows 1,32,128] [--blocks 64] [--steps 400] [--churn 16]
                                      [--before FILE] [--turns 3] [--label NAME] [--device cpu] [--out DIR]

A steady decode batch: each row a sequence whose table holds `--blocks` blocks (of 16 tokens), one
position further each step, a block more every 16 steps (the rows staggered); every `--churn` steps one
sequence finishes and a new one takes the last row (the rows after it shift, as the scheduler's order
does). The tables are the runner's lists, extended in place as `RequestState.blocks` is. Only the fill
is timed (`time.perf_counter` and the thread's CPU time, the median step), not the model: on a CPU the
graphs are not captured and the Triton attention would run in its interpreter.

``--before FILE``: an earlier `engine/attention/cuda_graphs.py` (``git show REV:lmiserve/engine/attention/
cuda_graphs.py > FILE``), whose `DecodeGraphs` is timed on the same steps, in turns with this checkout's
(`--turns`), so that both see the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("LMISERVE_ATTENTION_BACKEND", "triton")
os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU: Triton's interpreter (nothing runs it here)

BLOCK = 16


def graphs_class(path: Path | None) -> Any:
    """`DecodeGraphs` of this checkout, or of the module file at `path`."""
    if path is None:
        from lmiserve.engine.attention.cuda_graphs import DecodeGraphs

        return DecodeGraphs
    spec = importlib.util.spec_from_file_location("before_cuda_graphs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DecodeGraphs


def time_fill(graphs: Any, rows: int, blocks: int, steps: int, churn: int) -> tuple[float, float]:
    """Median wall and CPU microseconds of `_fill` a step over `steps` steps of the batch described above."""
    next_block = 0

    def table(length: int) -> list[int]:
        nonlocal next_block
        start, next_block = next_block, (next_block + length) % (graphs.cache.num_blocks - length - 1)
        return list(range(start, start + length))

    tables = [table(blocks) for _ in range(rows)]
    positions = [blocks * BLOCK - 1 - (row % BLOCK) for row in range(rows)]  # staggered block ends
    size = graphs.size_for(rows)
    walls, cpus = [], []
    import torch

    synchronize = torch.cuda.synchronize if graphs.fast.device.type == "cuda" else None  # the copies done
    for step in range(steps):
        for row in range(rows):
            positions[row] += 1
            if positions[row] // BLOCK >= len(tables[row]):
                tables[row].extend(table(1))
        if churn and step % churn == churn - 1:  # one sequence ends, the rows after it shift, a new one joins
            gone = step % rows
            del tables[gone], positions[gone]
            tables.append(table(blocks))
            positions.append(blocks * BLOCK - 1)
        ids = [5] * rows
        start, cpu = time.perf_counter(), time.thread_time()
        graphs._fill(ids, positions, tables, size)
        if synchronize is not None:
            synchronize()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,128")
    parser.add_argument("--blocks", type=int, default=64, help="blocks a row's table starts with (of 16 tokens)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--churn", type=int, default=16, help="a sequence replaced every N steps (0: never)")
    parser.add_argument("--before", type=Path, help="an earlier cuda_graphs.py to time in turns")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--label", default="this checkout", help="what the tables call this checkout's timings")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if min(rows_list) < 1 or args.blocks < 1 or args.steps < 1 or args.churn < 0 or args.turns < 1:
        parser.error("--rows, --blocks, --steps and --turns take positive numbers, --churn 0 or more")

    import torch
    from machine import cpu_model
    from transformers import AutoModelForCausalLM

    from helpers.tiny_model import build_tiny_model_dir
    from lmiserve.engine.attention.paged import PagedKVCache
    from lmiserve.engine.model.fast_llama import FastLlama

    torch.set_num_threads(1)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model_dir(Path(tmp) / "tiny")).to(device)
    cfg = model.config
    context = (args.blocks + args.steps // BLOCK + 2) * BLOCK
    num_blocks = max(rows_list) * (args.blocks + args.steps // BLOCK + 2) + 2
    kinds = {args.label: graphs_class(None)} | ({"before": graphs_class(args.before)} if args.before else {})
    results: dict[str, dict[int, list[tuple[float, float]]]] = {kind: {r: [] for r in rows_list} for kind in kinds}
    for _ in range(args.turns):
        for kind, cls in kinds.items():
            for rows in rows_list:
                cache = PagedKVCache(
                    cfg.num_hidden_layers, num_blocks + 1, BLOCK, cfg.num_key_value_heads, 16, model.dtype, device
                )
                graphs = cls(FastLlama(model, cache, context), max(rows_list), num_blocks)
                results[kind][rows].append(time_fill(graphs, rows, args.blocks, args.steps, args.churn))
    summary: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__},
        "args": {k: str(v) for k, v in vars(args).items()},
        "fill_us": {
            kind: {
                str(rows): {
                    "wall": round(statistics.median(w for w, _ in turns), 1),
                    "cpu": round(statistics.median(c for _, c in turns), 1),
                }
                for rows, turns in per_rows.items()
            }
            for kind, per_rows in results.items()
        },
    }
    lines = ["| rows | " + " | ".join(f"{kind} wall us | {kind} CPU us" for kind in kinds) + " |"]
    lines.append("|---" * (1 + 2 * len(kinds)) + "|")
    for rows in rows_list:
        cells = [" | ".join(str(summary["fill_us"][k][str(rows)][what]) for what in ("wall", "cpu")) for k in kinds]
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (args.out / "summary.md").write_text(f"Machine: {summary['machine']}\n\n{table}\n")


if __name__ == "__main__":
    main()
