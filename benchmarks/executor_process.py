"""The model in the engine's thread or in a process of its own (issue #20 item 5: vLLM v1 moved its
engine core into a process because of the GIL; which wins here?).

    .venv/bin/python benchmarks/executor_process.py [--concurrency 1,8,32] [--tokens 64] [--rounds 2]
        [--model-id PATH] [-o KEY=VALUE ...] [--json FILE]

Loads the bundled model (or `--model-id`) once in this process and once in a child; builds one engine
(block scheduler, detokenizer, grammar, everything that holds a `Sequence`) and runs the same greedy
requests with its model executed (a) in process, on the engine's torch thread (`InProcessExecutor`, what
the server does) and (b) in the child process (`benchmarks/process_executor.py`'s `ProcessExecutor`: the
step contract's plain-data batches pickled through a pipe), alternating, each level `--rounds` times.
Reports tokens/s per level and whether both gave the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.process_executor import ProcessExecutor, paged_fast_runner  # noqa: E402
from lmiserve.bench.baselines import load_like_server  # noqa: E402
from lmiserve.bench.prompts import PROMPTS  # noqa: E402
from lmiserve.config import load_settings  # noqa: E402
from lmiserve.core.request import GenerationRequest, SamplingParams  # noqa: E402
from lmiserve.engine import torch_thread  # noqa: E402
from lmiserve.engine.executors.in_process import InProcessExecutor  # noqa: E402
from lmiserve.engine.runner.fast import PagedFastRunner  # noqa: E402
from lmiserve.models.compose import build_engine  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402
from lmiserve.models.resolve import resolve_model_path  # noqa: E402


def parent_engine(overrides: dict):
    """The engine, built as the server builds it: on a thread that ends (torch_thread.run_apart), so the
    only live thread with an OpenMP team is the engine's torch thread (see engine/torch_thread.py)."""
    return build_engine(load_like_server(overrides), load_settings(overrides))


async def level(engine, concurrency: int, tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)

    async def one(i: int) -> list[int]:
        request = GenerationRequest(PROMPTS[i % len(PROMPTS)], params)
        return [e.token.id async for e in engine.generate(request) if e.token is not None]

    start = time.perf_counter()
    outputs = await asyncio.gather(*(one(i) for i in range(concurrency)))
    return sum(len(o) for o in outputs) / (time.perf_counter() - start), outputs


async def main(args: argparse.Namespace) -> dict:
    # no prefix cache: the two executors share the scheduler's pool bookkeeping, not its memory (the
    # child's blocks are its own), and a cached prompt would skip the prefill one executor has to do
    overrides: dict = {"enable_prefix_caching": False}
    if args.model_id:
        overrides["model_id"] = args.model_id
    for option in args.option:  # server settings, as `lmiserve serve -o` takes them
        key, _, value = option.partition("=")
        overrides[key.strip()] = value.strip()
    engine = await torch_thread.run_apart(parent_engine, overrides)
    settings = load_settings(overrides)
    runner = engine.runner
    assert isinstance(runner, PagedFastRunner), "the bench needs the paged fast runner (a Llama-family model)"
    print(f"parent kernels: {runner.kernels.describe()}", file=sys.stderr, flush=True)
    executors = {
        "thread": InProcessExecutor(runner),
        "process": ProcessExecutor(
            functools.partial(
                paged_fast_runner,
                functools.partial(
                    load_causal_lm,
                    str(resolve_model_path(settings.model_id, settings.revision, settings.model_cache_dir)),
                    dtype=settings.dtype,
                    device=settings.device,
                    load_format=settings.load_format,
                ),
                runner.num_blocks,
                runner.block_size,
                settings.max_rolling_batch_size,
                settings.cpu_autotune,
                settings.autotune_cache,
            )
        ),
    }
    engine.start()
    results: dict = {name: {} for name in executors}
    same = True
    try:
        for executor in executors.values():  # warm-up of each
            engine.executor = executor
            await level(engine, 2, 8)
        for concurrency in args.concurrency:
            for _ in range(args.rounds):
                outputs = {}
                for name, executor in executors.items():
                    engine.executor = executor
                    rate, outputs[name] = await level(engine, concurrency, args.tokens)
                    results[name].setdefault(concurrency, []).append(round(rate, 2))
                same = same and outputs["thread"] == outputs["process"]
                print(concurrency, {name: results[name][concurrency][-1] for name in executors}, flush=True)
    finally:
        await engine.stop()
        executors["process"].close()  # type: ignore[attr-defined]
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in model.splitlines() if line.startswith("Model name")), "")
    return {
        "what": "tokens/s of one engine with its model in the engine's thread or in a child process",
        "cpu": cpu or platform.processor(),
        "cpus": os.cpu_count(),
        "device": str(runner.device),
        "options": overrides,
        "tokens_per_request": args.tokens,
        "tokens_per_s": {name: {c: statistics.median(v) for c, v in r.items()} for name, r in results.items()},
        "runs": results,
        "same_tokens": same,
        "load_average_end": list(os.getloadavg()),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-o", "--option", action="append", default=[], help="a server setting, KEY=VALUE")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    report = asyncio.run(main(arguments))
    print(json.dumps(report, indent=1))
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=1) + "\n")
