"""Overlap scheduling against the serial loop (issue #39 item 1), in one run, in turns: the engine
(`create_engine`) with `async_scheduling` off and on, at 1, 32 and 128 greedy streams.

    python benchmarks/overlap_scheduling.py [--model-id DIR] [--device cpu] [--dtype fp32]
                                            [--load-format auto|dummy] [--kv-cache-memory-bytes N]
                                            [--rows 1,32,128] [--new-tokens 128] [--turns 3] [--out DIR]
                                            [--constrained-rows 128]

Each run submits `rows` requests at once (`ignore_eos`, `--new-tokens` each) and reads every stream to
its end. The figure is the decode rate once every stream has its first token: the tokens that came after
the last first token, over the time from it to the last token (so the prompts' prefill, the same in both,
is left out). Off and on run in turns (`--turns` pairs, drift hits both alike); the ratio is on / off of
the turns' medians. Every run's tokens must equal the first run's (greedy: overlap changes no token), and
the share of the steps planned ahead is reported (`EngineCore.steps_ahead`). Without --model-id: the
tests' tiny Llama (2 layers, hidden 64, vocab 512, fp32), where the host's Python is most of a step.

`--constrained-rows`: at each of these row counts, once more with one stream constrained (`[a-z ,.]+`, a
grammar that never completes: it runs to its length as the others do), whose mask follows its token before
(the steps planned ahead hold its row until the step before is applied: docs/engine.md, "Grammars planned
ahead"); those results carry `"constrained": 1`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Large language models predict the next token.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text too.",
]


async def measure(
    loaded: Any, rows: int, new_tokens: int, overlap: bool, kv_bytes: int | None, constrained: int = 0
) -> dict[str, Any]:
    """One engine, `rows` streams at once (the first `constrained` of them following a grammar): the decode
    rate after the last first token, and the tokens."""
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine

    config = EngineConfig(
        max_running=rows,
        max_prefill_tokens=max(64, 16 * rows),
        async_scheduling=overlap,
        kv_cache_memory_bytes=kv_bytes,
    )
    engine = create_engine(loaded, config)
    tokens, rate = await run_streams(engine, rows, new_tokens, constrained)
    return {
        "rows": rows,
        "overlap": overlap,
        "tokens_per_s": rate,
        "steps": engine.steps,
        "steps_ahead_share": round(engine.steps_ahead / max(engine.steps, 1), 3),
        "tokens": tokens,
    }


async def run_streams(engine: Any, rows: int, new_tokens: int, constrained: int = 0) -> tuple[list[list[int]], Any]:
    """`engine` started, `streams` run on it, the engine stopped."""
    engine.start()
    try:
        return await streams(engine, rows, new_tokens, constrained)
    finally:
        await engine.stop()


async def streams(engine: Any, rows: int, new_tokens: int, constrained: int = 0) -> tuple[list[list[int]], Any]:
    """`rows` streams at once on the running `engine` (`ignore_eos`, `new_tokens` each; the first `constrained`
    following `[a-z ,.]+`), read to their ends: their tokens, and the decode rate after the last first token
    (None when nothing came after it)."""
    from lmiserve.core.grammar import Grammar
    from lmiserve.core.request import GenerationRequest, SamplingParams

    firsts: list[float] = []
    stamps: list[list[float]] = []

    async def consume(i: int) -> list[int]:
        prompt = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
        grammar = Grammar("regex", "[a-z ,.]+") if i < constrained else None
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True, grammar=grammar)
        request = GenerationRequest(prompt, params)
        ids, times = [], []
        async for event in engine.generate(request):
            if event.token is not None:
                ids.append(event.token.id)
                times.append(time.perf_counter())
            if event.finish is not None:
                assert event.finish.error is None, event.finish.error
        firsts.append(times[0])
        stamps.append(times)
        return ids

    tokens = await asyncio.gather(*(consume(i) for i in range(rows)))
    start = max(firsts)
    end = max(t[-1] for t in stamps)
    after = sum(1 for times in stamps for t in times if t > start)
    return tokens, round(after / (end - start), 1) if end > start else None


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| rows | serial tok/s | overlapped tok/s | ratio | steps planned ahead | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows = f"{r['rows']}, one constrained" if r.get("constrained") else r["rows"]
        lines.append(
            f"| {rows} | {r['off_tokens_per_s']:.1f} | {r['on_tokens_per_s']:.1f} | {r['ratio']:.2f}x | "
            f"{100 * r['steps_ahead_share']:.0f} % | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def write_summary(out: Path | None, env: dict[str, Any], summary: str, results: list[dict[str, Any]]) -> None:
    """The table printed; with `out`, it and the results written there (summary.md, summary.json)."""
    print(summary)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"env": env, "argv": sys.argv, "results": results}, indent=1))
        (out / "summary.md").write_text(f"{env}\n\n{summary}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="a model directory (default: the tests' tiny Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a shape's config alone)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="the KV pool's budget (default: by device)")
    parser.add_argument("--rows", default="1,32,128")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--turns", type=int, default=3, help="off/on pairs per row count")
    parser.add_argument("--out", type=Path, help="a directory for summary.json and summary.md")
    parser.add_argument("--constrained-rows", default="", help="row counts run again with one constrained stream")
    args = parser.parse_args()

    from lmiserve.core import threads

    wait = threads.prepare_environment(threads.choose(None)).wait_policy  # as `lmiserve serve` does
    import torch

    from lmiserve.models.load import load_causal_lm

    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with ExitStack() as stack:
        model_dir = args.model_id
        if model_dir is None:
            from helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"))
        loaded = load_causal_lm(model_dir, dtype=args.dtype, device=args.device, load_format=args.load_format)
        kv = args.kv_cache_memory_bytes
        passes = [(int(r), 0) for r in args.rows.split(",")]
        passes += [(int(r), 1) for r in args.constrained_rows.split(",") if r]
        for rows, constrained in passes:
            asyncio.run(measure(loaded, rows, 8, False, kv, constrained))  # warm-up: shapes, caches
            runs = [
                asyncio.run(measure(loaded, rows, args.new_tokens, overlap, kv, constrained))
                for _ in range(args.turns)
                for overlap in (False, True)
            ]
            reference = runs[0]["tokens"]
            same = all(r["tokens"] == reference for r in runs)
            off = round(statistics.median(r["tokens_per_s"] for r in runs if not r["overlap"]), 1)
            on = round(statistics.median(r["tokens_per_s"] for r in runs if r["overlap"]), 1)
            result = {
                "rows": rows,
                **({"constrained": constrained} if constrained else {}),
                "off_tokens_per_s": off,
                "on_tokens_per_s": on,
                "ratio": round(on / off, 3),
                "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                "same_tokens": same,
                "steps_ahead_share": statistics.median(r["steps_ahead_share"] for r in runs if r["overlap"]),
            }
            print(json.dumps(result), flush=True)
            results.append(result)
    from machine import cpu_model

    cpu = cpu_model()
    env = {
        "cpu": cpu,
        "device": args.device,
        "model": args.model_id or "tiny Llama (tests)",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "openmp_wait": wait,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
    }
    write_summary(args.out, env, table(results), results)


if __name__ == "__main__":
    main()
