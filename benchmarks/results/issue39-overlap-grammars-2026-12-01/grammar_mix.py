"""One constrained stream among plain ones, with overlap scheduling (issue #39): how many steps are planned
ahead, and the decode rate, in three modes run in turns in one process:

- `serial`: `async_scheduling` off;
- `before`: on, but the executor takes no masks after a step's launch (`scheduler.masks_later = False`):
  the engine before this change, where any sequence that may be masked plans every step after the one
  before it;
- `after`: on, the masks sent once the step before is applied (`StepBatch.mask_later`).

    PYTHONPATH=. python benchmarks/results/issue39-overlap-grammars-2026-12-01/grammar_mix.py \\
        [--model-id DIR] [--rows 16,64] [--constrained 1] [--new-tokens 64] [--device-ms 0,4] [--turns 3] [--out F]

`--device-ms`: a stand-in for a device's step, for a CPU with no GPU: each forward then sleeps that long on
the torch thread (the GIL let go, as a thread waiting for a GPU does), so the host's work of the step before
(its update, detokenizing, stops, events, the next plan, the masks) can run meanwhile, as on a GPU. It is
not a GPU: no kernel runs during the sleep, and the model's own CPU forward comes on top of it.

The rate is the tokens after the last stream's first token over the time from it to the last token. The
gap is what a device would wait between two steps: the median time on the torch thread from the end of one
step's rows (after the stand-in) to the start of the next step's, over the decode steps after the first ten.
`mask_task`: in `after`, the wall and CPU time (the torch thread's) of each step's late masks and sampling
(`StepMasks.sample_held`), medians. Every
run's tokens must be the first run's (greedy: the modes change no token). The constrained streams follow
`[a-z ,.]+` (never complete: they run to `--new-tokens`, as the plain ones, `ignore_eos`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from overlap_scheduling import run_streams  # noqa: E402 - the same streams

MODES = ("serial", "before", "after")
SPANS: list[tuple[float, float, int]] = []  # each step's rows on the torch thread: start, end, rows
MASK_TASKS: list[tuple[float, float]] = []  # each `sample_held`: wall, CPU (the torch thread's) seconds


async def measure(loaded: Any, rows: int, constrained: int, new_tokens: int, mode: str) -> dict[str, Any]:
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine

    config = EngineConfig(max_running=rows, max_prefill_tokens=max(64, 16 * rows), async_scheduling=mode != "serial")
    engine = create_engine(loaded, config)
    engine.scheduler.masks_later = engine.scheduler.masks_later and mode == "after"  # type: ignore[attr-defined]
    SPANS.clear()
    MASK_TASKS.clear()
    tokens, rate = await run_streams(engine, rows, new_tokens, constrained)
    steady = [span for span in SPANS if span[2] == rows][10:]  # (every stream decoding)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(steady)]
    return {
        "mode": mode,
        "tokens_per_s": rate,
        "steps": engine.steps,
        "steps_ahead_share": round(engine.steps_ahead / max(engine.steps, 1), 3),
        "gap_ms": round(1000 * statistics.median(gaps), 3) if gaps else None,
        "mask_task_ms": [round(1000 * statistics.median(t[k] for t in MASK_TASKS), 3) for k in (0, 1)]
        if MASK_TASKS
        else None,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="a model directory or GGUF (default: the tests' tiny Llama)")
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--constrained", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device-ms", default="0,4")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from lmiserve.core import threads

    threads.prepare_environment(threads.choose(None))  # as `lmiserve serve` does
    import torch
    from machine import cpu_model

    from lmiserve.engine.core.step_masks import StepMasks
    from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner
    from lmiserve.models.load import load_causal_lm

    results = []
    with ExitStack() as stack:
        model_dir = args.model_id
        if model_dir is None:
            from helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"))
        loaded = load_causal_lm(model_dir, dtype="fp32", device="cpu")
        run_rows, sample_held = PersistentBatchRunner._run_rows, StepMasks.sample_held

        def timed(masks, plan):  # noqa: ANN001, ANN202 - StepMasks.sample_held's
            wall, cpu = time.perf_counter(), time.thread_time()
            failed = sample_held(masks, plan)
            MASK_TASKS.append((time.perf_counter() - wall, time.thread_time() - cpu))
            return failed

        StepMasks.sample_held = timed  # type: ignore[method-assign]
        for device_ms in [float(v) for v in args.device_ms.split(",")]:

            def with_device(runner, batch, part, out, _ms=device_ms):  # noqa: ANN001, ANN202 - _run_rows'
                start = time.perf_counter()
                run_rows(runner, batch, part, out)
                time.sleep(_ms / 1000)  # (the step's "device time": the GIL let go)
                SPANS.append((start, time.perf_counter(), len(part)))

            PersistentBatchRunner._run_rows = with_device  # type: ignore[method-assign]
            for rows in [int(r) for r in args.rows.split(",")]:
                asyncio.run(measure(loaded, rows, args.constrained, 8, "after"))  # warm-up
                runs = [
                    asyncio.run(measure(loaded, rows, args.constrained, args.new_tokens, mode))
                    for _ in range(args.turns)
                    for mode in MODES
                ]
                same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
                result: dict[str, Any] = {"device_ms": device_ms, "rows": rows, "same_tokens": same}
                for mode in MODES:
                    mine = [r for r in runs if r["mode"] == mode]
                    result[mode] = {
                        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                        "steps_ahead_share": statistics.median(r["steps_ahead_share"] for r in mine),
                        "gap_ms": statistics.median(r["gap_ms"] for r in mine),
                        "mask_task_ms": mine[len(mine) // 2]["mask_task_ms"],
                        "runs": [r["tokens_per_s"] for r in mine],
                    }
                print(json.dumps(result), flush=True)
                results.append(result)
        PersistentBatchRunner._run_rows = run_rows  # type: ignore[method-assign]
    lines = [
        "| device ms | rows | serial: tok/s, gap | before: tok/s, gap, planned ahead "
        "| after: tok/s, gap, planned ahead | same tokens | after: mask task ms (wall, CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        serial, before, after = r["serial"], r["before"], r["after"]
        lines.append(
            f"| {r['device_ms']:g} | {r['rows']} | {serial['tokens_per_s']:.0f}, {serial['gap_ms']:.2f} ms | "
            f"{before['tokens_per_s']:.0f}, {before['gap_ms']:.2f} ms, {100 * before['steps_ahead_share']:.0f} % | "
            f"{after['tokens_per_s']:.0f}, {after['gap_ms']:.2f} ms, {100 * after['steps_ahead_share']:.0f} % | "
            f"{'yes' if r['same_tokens'] else 'NO'} | {after['mask_task_ms']} |"
        )
    env = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(), "argv": sys.argv}
    print(env)
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps({"env": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()
