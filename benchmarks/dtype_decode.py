"""Decode tokens/s per dtype at batch 1/8/32: lmiserve's fast forward against the bare transformers
forward of the same dtype, interleaved, in one process.

    .venv/bin/python benchmarks/dtype_decode.py [--dtypes fp32,bf16,int8] [--batches 1,8,32] [--steps 12]
        [--kernels autotune|static]

For each batch size every (dtype, forward) pair runs one decode step in turn, `--steps` rounds, so
load from other work on a shared machine hits all of them alike. The fast forward decodes rows at
the positions `lmiserve bench`'s prompts reach (33..192), each row through its own blocks of a paged KV
pool (`BLOCK_SIZE` tokens a block, as the server's default), with the kernels the server would pick
(`--kernels autotune`: measured now, without the cache; `static`: the built-in defaults; `both`:
both, as "fast <dtype> static" and "fast <dtype>"); the bare
forward is the model's own forward over a `DynamicCache` prefilled with 100 tokens per row (what
`lmiserve bench` calls baseline (a)). Prints one JSON report: median and best step per pair, tokens/s
from the median, the CPU, flags and load averages before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from lmiserve.core.cpu_info import cpu_info
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model import autotune
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.models import load_causal_lm, resolve_model_path

BLOCK_SIZE = 16
ROW_POSITIONS = 256  # a row's blocks in the pool: past the 192 positions a step reaches


def fast_forward(loaded, rows: int, kernels: str) -> tuple[FastLlama, str]:
    """The fast forward over a pool of `rows` rows' blocks; its kernels measured now or the static ones."""
    cache = paged_cache(loaded.model, rows * ROW_POSITIONS // BLOCK_SIZE, BLOCK_SIZE)
    fast = FastLlama(loaded.model, cache, 2048)
    choice = autotune.measure(fast, rows) if kernels == "autotune" else None
    return fast, choice.describe() if choice else "static"


def fast_step(fast: FastLlama, rows: int):
    positions = [32 + (i * 131) % 160 for i in range(rows)] if rows > 1 else [100]
    ids = [5 + i for i in range(rows)]
    per_row = ROW_POSITIONS // BLOCK_SIZE
    tables = [[row * per_row + j for j in range(p // BLOCK_SIZE + 1)] for row, p in enumerate(positions)]
    inputs = StepInputs(ids, positions, tables, keep=list(range(rows)))
    return lambda: fast.forward(inputs)


def bare_step(loaded, rows: int):
    model = loaded.model
    ids = torch.randint(100, 1000, (rows, 100))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    state = {"pos": torch.full((rows, 1), 100), "tok": ids[:, -1:]}

    def step() -> None:
        out = model(input_ids=state["tok"], past_key_values=cache, use_cache=True, position_ids=state["pos"])
        state["tok"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["pos"] = state["pos"] + 1

    return step


def timed_in_turn(steps: dict[str, Callable[[], object]], rounds: int, rows: int) -> dict[str, dict[str, float]]:
    """Each of `steps` once a round, in turn, `rounds` rounds after a warm-up round (so load from other work on a
    shared machine hits them alike): each one's median and best step (ms) and tokens/s at the median, `rows` tokens
    a step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {
        name: {
            "median_ms": round(statistics.median(ts) * 1000, 2),
            "best_ms": round(min(ts) * 1000, 2),
            "tokens_per_s": round(rows / statistics.median(ts), 1),
        }
        for name, ts in times.items()
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtypes", default="fp32,bf16,int8")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kernels", choices=["autotune", "static", "both"], default="autotune")
    parser.add_argument("--budget", type=float, default=autotune.BUDGET_S, help="autotune time budget, seconds")
    args = parser.parse_args()
    autotune.BUDGET_S = args.budget
    path = resolve_model_path(args.model_id, None, None)
    dtypes = args.dtypes.split(",")
    models = {d: load_causal_lm(path, dtype=d, device="cpu") for d in dtypes}
    report = {
        "model": str(path),
        "cpu": cpu_info().as_dict(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_before": os.getloadavg(),
        "kernels": args.kernels,
        "batches": {},
    }
    batches = [int(b) for b in args.batches.split(",")]
    fasts, chosen = {}, {}
    for d in dtypes:
        if args.kernels == "both":
            fasts[f"{d} static"], chosen[f"{d} static"] = fast_forward(models[d], max(batches), "static")
        fasts[d], chosen[d] = fast_forward(
            models[d], max(batches), "static" if args.kernels == "static" else "autotune"
        )
        print(d, chosen[d], flush=True)
    report["kernels_chosen"] = chosen
    for rows in batches:
        steps = {}
        for d in dtypes:
            if f"{d} static" in fasts:
                steps[f"fast {d} static"] = fast_step(fasts[f"{d} static"], rows)
            steps[f"fast {d}"] = fast_step(fasts[d], rows)
            steps[f"bare {d}"] = bare_step(models[d], rows)
        entry: dict[str, Any] = {**timed_in_turn(steps, args.steps, rows), "load_average": os.getloadavg()}
        for d in dtypes:
            entry[f"fast {d} / bare {d}"] = round(entry[f"bare {d}"]["median_ms"] / entry[f"fast {d}"]["median_ms"], 2)
            entry[f"fast {d} / bare fp32"] = (
                round(entry["bare fp32"]["median_ms"] / entry[f"fast {d}"]["median_ms"], 2)
                if "bare fp32" in entry
                else None
            )
        report["batches"][rows] = entry
        print(json.dumps({rows: entry}), flush=True)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
