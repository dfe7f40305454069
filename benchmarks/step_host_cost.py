"""Where a decode step's time goes on the host (issue #39): a tiny model at 1, 32 and 128 decode rows through
the whole engine (the scheduler, the runner, the update), so that the Python around the model shows.

    python benchmarks/step_host_cost.py [--model-id DIR [--load-format dummy]] [--device cpu] [--dtype fp32]
                                        [--quantize fp8] [--rows 1,32,128] [--paths fast,generic] [--steps 100]
                                        [--out DIR] [--profile]
                                        [--no-drain] [--compare-before N --before-scheduler FILE] [--mixed P]
                                        [--graph-pick] [--top-n-rows K] [--penalty-rows K]

For each path (``fast``: lmiserve's forward; ``generic``: transformers' forward over the blocks) and each
row count, an engine (`create_engine`) runs that many greedy requests at once; once they all decode, each
step's spans are timed with `time.perf_counter` by wrapping the engine's own functions:

- ``plan``: the scheduler's planning and the step's `StepBatch` (`BlockScheduler.schedule`);
- ``batch update``: the runner's persistent batch taking the step's difference (`launch_batch` less its
  rows' forward and sampling);
- ``inputs``: the forward's host side: the ids, positions, RoPE rows, block tables and kept rows as tensors
  (`_forward_rows` less the model and the attention metadata);
- ``metadata``: the attention backend's per-step plan (`attention.plan`);
- ``model``: the layers and the logits (the fast path's `_layers` and `_logits`; the generic path's
  transformers forward, `_logits`);
- ``sampling``: every row sampled (`_finish_rows`);
- ``update``: the scheduler's update: tokens appended, detokenized, stop checks, the events
  (`scheduler.update`);
- ``deliver``: the step's events stamped and put on their streams' queues (`_stamp`, `_deliver`);
- ``hop``: from the step handed to the torch thread (`run_in_executor`) until it runs there, and from its
  end until the event loop takes the result up: thread wake-ups, and the event loop's other work meanwhile
  (the streams' consumers; ``--no-drain``: none, the events stay queued);
- ``event loop`` (CPU time only): the event loop thread's CPU time in the step less its spans (``plan``,
  ``deliver``): the streams' consumers and asyncio;
- ``loop``: the rest of the step's period (from one step's start to the next's, less the above): the
  engine loop's own code and the time the torch thread waits for the GIL or a core.

``--graph-pick`` follows a GPU's greedy decode step on the host: a CUDA graph computes the step's greedy
picks with its logits and the runner only starts their transfer (`_send_pick`); here the runner is handed
the same call, whose pick is computed when the tokens are received (the next step's ``batch update``, or
the collect after the step). ``sampling`` is then the host's bookkeeping of a graph's step alone.

``--top-n-rows K``: K of the rows also ask for the top 5 tokens at each token (OpenAI's ``top_logprobs``,
TGI's ``top_n_tokens``); with ``--graph-pick`` they go with the graph's pick (before 2026-12-01 every row of
such a step went to the eager sampler). ``--penalty-rows K``: K (other) rows ask for a repetition penalty
of 1.2, which a graph does not sample: those rows alone go to the eager sampler, the others take the
graph's pick (before 2026-12-01: every row of the step).

``--mixed P`` adds, at each row count, a run where prompts of P tokens keep joining the rows (one at a
time, each ending at its first token): its figures are those of the steps that carry the rows and a
prompt, with ``mixed_over_decode``, their period over the same run's decode-only steps'. On CUDA such a
step runs eagerly (the decode graphs take decode rows alone): the ratio is what a prompt joining costs the
streams it joins, the 32-stream level's ITL p99 of the GPU checks.

The host's share is the period less ``model``. Each span's CPU time on the thread that runs it
(`time.thread_time`) is reported too: on a busy machine the wall times carry other processes' turns,
the CPU times do not. ``--profile`` also writes, for the largest row count, a cProfile of the torch thread's
side of the steps (`_execute`) and of the planning, and a torch profiler table (``record_function`` spans), in
``--out``; on CUDA also ``kernels-<path>-<rows>.json``, the GPU's time a step by kernel (`gpu_kernels`: those a
decode graph replays too), which the GPU check's ``step-profile-8b`` reads for bf16 and ``--quantize fp8``
(where fp8 weights lose or win a step's time). Without --model-id: the tests' tiny Llama (2 layers, hidden 64,
vocab 512, fp32), built in a temporary directory. ``--device cuda`` (NOT RUN ON A GPU yet): the spans are host
time; the model's is its kernel launches, and the wait for the GPU lands in the span that synchronizes
(sampling's one transfer of the step's tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import importlib.util
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import types
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SPANS = ["plan", "batch update", "inputs", "metadata", "model", "sampling", "update", "deliver", "hop", "loop"]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today?",
    "Large language models predict the next token.",
    "Numbers like 1, 2, 3, 42 and 2024 appear in text too.",
]


BEFORE: dict[str, Any] = {"schedule_running": None}  # --before-scheduler's planning


def load_function(path: Path, cls: str, name: str) -> Any:
    """`cls.name` of the module at `path` (an earlier version of one of lmiserve's modules)."""
    spec = importlib.util.spec_from_file_location(f"before_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(getattr(module, cls), name)


class Spans:
    """Per-step sums of the wrapped functions' times (`current`, while a counted step runs)."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.torch_profiling = False

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace `owner.name` (an instance's method) by a timed call adding to `label`."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                if self.torch_profiling:
                    import torch

                    with torch.profiler.record_function(label):
                        return original(*args, **kwargs)
                return original(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current[label] = self.current.get(label, 0.0) + time.perf_counter() - start
                    key = f"cpu {label}"  # this thread's CPU time: what a busy machine's preemptions leave out
                    self.current[key] = self.current.get(key, 0.0) + time.thread_time() - cpu

        setattr(owner, name, timed)


def instrument(engine: Any, spans: Spans) -> None:
    """Wrap the engine's functions (the module's doc says which)."""
    runner = engine.runner
    spans.wrap(engine.scheduler, "schedule", "plan")
    spans.wrap(engine.scheduler, "update", "update")
    spans.wrap(engine, "_execute", "_execute")
    spans.wrap(engine, "_deliver", "deliver")
    spans.wrap(engine, "_stamp", "deliver")
    spans.wrap(runner, "launch_batch", "_execute_batch")
    spans.wrap(runner, "_run_rows", "_run_rows")
    spans.wrap(runner, "_forward_rows", "_forward_rows")
    spans.wrap(runner, "_finish_rows", "sampling")
    fast = getattr(runner, "fast", None)
    if fast is not None:
        spans.wrap(fast, "_layers", "model")
        spans.wrap(fast, "_logits", "model")
        spans.wrap(fast.attention, "plan", "metadata")
    else:
        spans.wrap(runner, "_logits", "model")
        spans.wrap(runner.attention, "plan", "metadata")


def breakdown(raw: dict[str, float], period: float, prefix: str = "") -> dict[str, float]:
    """The module doc's spans (seconds) of one step from the wrapped functions' sums; ``loop`` is the rest
    of the period, so the spans add up to it. `prefix` "cpu ": the calling threads' CPU times of the spans
    instead (no hop, no loop)."""

    def get(label: str) -> float:
        return raw.get(prefix + label, 0.0)

    forward, model, metadata = get("_forward_rows"), get("model"), get("metadata")
    spans = {
        "plan": get("plan"),
        "batch update": get("_execute_batch") - get("_run_rows"),
        "inputs": forward - model - metadata,
        "metadata": metadata,
        "model": model,
        "sampling": get("sampling"),
        "update": get("update"),
        "deliver": get("deliver"),
    }
    if prefix:
        return {prefix + k: v for k, v in spans.items()}
    return spans | {"hop": get("hop"), "loop": period - sum(spans.values()) - get("hop")}


async def measure(
    loaded: Any,
    path: str,
    rows: int,
    steps: int,
    warmup: int,
    profile_dir: Path | None,
    drain: bool = True,
    before: bool = False,
    mixed: int = 0,
    graph_pick: bool = False,
    top_n_rows: int = 0,
    penalty_rows: int = 0,
) -> dict:
    """One engine at `rows` decode rows: the mean spans of `steps` decode steps after `warmup` ones (the
    slowest and the fastest tenth left out). `mixed` > 0: the same rows while prompts of that many tokens
    keep joining (one at a time, each ending at its first token): the spans of the steps that carry the
    rows and a prompt (on CUDA these run eagerly, the decode-only steps replay a graph), and the mean
    decode-only step of the same run (`decode_period_ms`) for the ratio."""
    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine

    # the serial loop (its spans are what is timed; benchmarks/overlap_scheduling.py times the overlapped one)
    config = EngineConfig(
        max_running=rows + (1 if mixed else 0),
        max_prefill_tokens=max(64, 16 * rows, mixed),
        fast_path=path == "fast",
        async_scheduling=False,
    )
    engine = create_engine(loaded, config)
    if graph_pick:  # the module doc's --graph-pick: the picks in flight, as a decode graph's
        from lmiserve.engine.runner.sampling import greedy_pick

        def pick(at: Any, top_n: int) -> Any:
            rows = greedy_pick(at)
            if top_n:  # (graph_sampling.with_top_n: since 2026-12-01 the top-N go with a graph's pick)
                from lmiserve.engine.runner.graph_sampling import with_top_n

                rows = with_top_n(rows, at, top_n)
            return rows.tolist()

        def send_pick(logits: Any, sampled: bool = False, top_n: int = 0) -> Any:  # (greedy picks alone)
            return None if sampled else functools.partial(pick, logits, top_n)

        engine.runner._send_pick = send_pick
    if before:  # as before issue #39's host fixes: transformers' decode (engine/text/tokenizer.py) and the
        engine.codec.tokenizer._direct = None  # type: ignore[attr-defined]
        if BEFORE["schedule_running"] is not None:  # planning of --before-scheduler's file (serial steps only)
            before = types.MethodType(BEFORE["schedule_running"], engine.scheduler)
            engine.scheduler._schedule_running = lambda plan, ahead=False: before(plan)  # type: ignore[method-assign]
    spans = Spans()
    instrument(engine, spans)
    periods: dict[str, list[dict[str, float]]] = {"decode": [], "mixed": []}
    counts = {"decode": 0, "mixed": 0}  # steps of each kind so far
    state: dict[str, Any] = {"start": 0.0, "cpu": 0.0, "raw": {}, "counted": None}
    cprofiles = {"torch thread": cProfile.Profile(), "plan": cProfile.Profile()} if profile_dir else {}
    torch_prof = None
    total = warmup + steps

    original_step, original_schedule, original_execute = engine._step, engine.scheduler.schedule, engine._execute
    # (with `profile_dir` the spans are not the figures: cProfile slows the Python it watches)

    measured = "mixed" if mixed else "decode"  # the kind of step the figures are of

    def schedule(now: float, ahead: bool = False) -> Any:
        profiling = counts[measured] >= warmup and cprofiles
        if profiling:
            cprofiles["plan"].enable()
        plan, events = original_schedule(now, ahead=ahead)
        if profiling:
            cprofiles["plan"].disable()
        state["handed"] = time.perf_counter()  # the step goes to the torch thread
        full = len(plan.decode) == rows
        state["kind"] = ("mixed" if plan.prefill else "decode") if full else None
        return plan, events

    def execute(plan: Any) -> Any:
        nonlocal torch_prof
        arrived = time.perf_counter()
        state["raw"]["hop"] = state["raw"].get("hop", 0.0) + arrived - state.pop("handed", arrived)
        profiling = state.get("kind") == measured and counts[measured] >= warmup and cprofiles
        if profiling and torch_prof is None and profile_dir is not None:  # on the torch thread: its ops
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if loaded.device.type == "cuda":  # the kernels too: where the GPU's time goes
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch_prof = torch.profiler.profile(activities=activities)
            torch_prof.__enter__()
            spans.torch_profiling = True
        if profiling:
            cprofiles["torch thread"].enable()
        try:
            return original_execute(plan)
        finally:
            if profiling:
                cprofiles["torch thread"].disable()
            state["returned"] = time.perf_counter()
            if spans.torch_profiling and counts[measured] >= warmup + 10 and torch_prof is not None:
                spans.torch_profiling = False
                torch_prof.__exit__(None, None, None)
                assert profile_dir is not None
                averages = torch_prof.key_averages()
                slug = f"{path}-{rows}" + ("-mixed" if mixed else "")
                (profile_dir / f"torch-{slug}.txt").write_text(
                    averages.table(sort_by="self_cpu_time_total", row_limit=40)
                )
                if loaded.device.type == "cuda":
                    (profile_dir / f"torch-{slug}-cuda.txt").write_text(
                        averages.table(sort_by="self_cuda_time_total", row_limit=40)
                    )
                profiled = counts[measured] - warmup + 1  # (this step's too: its kernels are in the profile)
                kernels = gpu_kernels(torch_prof.events(), profiled)
                (profile_dir / f"kernels-{slug}.json").write_text(json.dumps(kernels, indent=1))

    original_stamp = engine._stamp

    def stamp(events: Any, now: float) -> Any:  # the first call after the step: back on the event loop
        back = time.perf_counter()
        state["raw"]["hop"] = state["raw"].get("hop", 0.0) + back - state.pop("returned", back)
        return original_stamp(events, now)

    engine.scheduler.schedule, engine._execute, engine._stamp = schedule, execute, stamp  # type: ignore[method-assign]

    async def step() -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if state["counted"] is not None:
            period, raw = now - state["start"], state["raw"]
            # the event loop thread's CPU time of the step, less its spans: the streams' consumers, asyncio
            other = cpu - state["cpu"] - raw.get("cpu plan", 0.0) - raw.get("cpu deliver", 0.0)
            periods[state["counted"]].append(
                breakdown(raw, period) | breakdown(raw, period, "cpu ") | {"period": period, "cpu event loop": other}
            )
        state["cpu"] = cpu
        state["start"], state["raw"], state["counted"], state["kind"] = now, {}, None, None
        spans.current = state["raw"]
        await original_step()
        kind = state["kind"]
        if kind is not None:
            if warmup <= counts[kind] < total:
                state["counted"] = kind
            counts[kind] += 1

    engine._step = step  # type: ignore[method-assign]

    done = asyncio.Event()

    async def consume(i: int) -> int:
        prompt = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
        # with prompts joining, about half the steps carry one: enough tokens for both kinds' counts
        tokens = min((4 if mixed else 1) * total + 40, engine.codec.max_context - 32)
        top_n = 5 if i < top_n_rows else 0  # (the module doc's --top-n-rows and --penalty-rows)
        penalty = 1.2 if top_n_rows <= i < top_n_rows + penalty_rows else 1.0
        params = SamplingParams(
            max_new_tokens=tokens, ignore_eos_token=True, top_n_tokens=top_n, repetition_penalty=penalty
        )
        request = GenerationRequest(prompt, params)
        if drain:
            return len([e async for e in engine.generate(request) if e.token is not None])
        handle = engine.submit(request)  # nobody reads its queue until it ends
        while not handle.seqs[0].finished:
            await asyncio.sleep(0.05)
        return handle.queue.qsize()

    async def join() -> None:
        """Prompts of `mixed` tokens, one after the other (each its own salt: no cached prefix), until the
        rows end: each ends at its first token, so the steps it is in carry the rows and its prompt."""
        words = [i for i in engine.codec.tokenizer.encode(" ".join(PROMPTS)) if i not in engine.codec.special_token_ids]
        number = 0
        while not done.is_set():
            number += 1
            ids = [words[(5 * i + number) % len(words)] for i in range(mixed)]
            params = SamplingParams(max_new_tokens=1, ignore_eos_token=True)
            request = GenerationRequest("", params, prompt_ids=ids, cache_salt=f"step-host-cost-{number}")
            async for _ in engine.generate(request):
                pass

    async def rows_then_done() -> list[int]:
        try:
            return await asyncio.gather(*(consume(i) for i in range(rows)))
        finally:
            done.set()

    engine.start()
    started = time.perf_counter()
    try:
        await asyncio.gather(rows_then_done(), *([join()] if mixed else []))
    finally:
        await engine.stop()
    wall = time.perf_counter() - started
    if profile_dir is not None:
        for name, prof in cprofiles.items():
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)
            slug = name.replace(" ", "-") + ("-mixed" if mixed else "")
            (profile_dir / f"cprofile-{path}-{rows}-{slug}.txt").write_text(text.getvalue())

    def trimmed(kind: str) -> tuple[list[dict[str, float]], dict[str, float]]:
        """The counted steps of `kind` by period, and the means of their middle 80 %."""
        counted = sorted(periods[kind][:steps], key=lambda p: p["period"])
        trim = len(counted) // 10  # the slowest and fastest tenth of the steps dropped: a busy machine's outliers
        kept = counted[trim : len(counted) - trim] or counted
        return counted, {k: statistics.fmean(p[k] for p in kept) for k in kept[0]}

    counted, mean = trimmed(measured)
    host = mean["period"] - mean["model"]
    extra: dict[str, Any] = {}
    if mixed:
        extra = {"prompt_tokens": mixed}
        if periods["decode"]:
            decode = trimmed("decode")[1]["period"]
            extra |= {
                "decode_period_ms": round(decode * 1e3, 4),
                "mixed_over_decode": round(mean["period"] / decode, 3),
            }
    return extra | {
        "path": path
        + ("" if drain else ", no drain")
        + (", before" if before else "")
        + (f", mixed {mixed}" if mixed else "")
        + (", graph pick" if graph_pick else "")
        + (f", {top_n_rows} top-N rows" if top_n_rows else "")
        + (f", {penalty_rows} penalty rows" if penalty_rows else ""),
        "rows": rows,
        "steps": len(counted),
        "ms": {k: round(v * 1e3, 4) for k, v in mean.items() if not k.startswith("cpu ")},
        "cpu_ms": {k[4:]: round(v * 1e3, 4) for k, v in mean.items() if k.startswith("cpu ")},
        "median_period_ms": round(statistics.median(p["period"] for p in counted) * 1e3, 4),
        "host_ms": round(host * 1e3, 4),
        "host_share": round(host / mean["period"], 4),
        "share": {k: round(mean[k] / mean["period"], 4) for k in SPANS},
        "tokens_per_s": round(rows / mean["period"], 1),
        "wall_s": round(wall, 2),
    }


def table(results: list[dict]) -> str:
    head = "| path | rows | step ms | model ms | host ms (share) | " + " | ".join(SPANS[:4] + SPANS[5:]) + " | tok/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ms, share = r["ms"], r["share"]
        cells = [f"{ms[k]:.3f} ({100 * share[k]:.0f} %)" for k in SPANS if k != "model"]
        lines.append(
            f"| {r['path']} | {r['rows']} | {ms['period']:.3f} | {ms['model']:.3f} | "
            f"{r['host_ms']:.3f} ({100 * r['host_share']:.0f} %) | " + " | ".join(cells) + f" | {r['tokens_per_s']} |"
        )
    return "\n".join(lines)


def cpu_table(results: list[dict]) -> str:
    """The host spans' CPU time (the calling thread's: the model's OpenMP workers not counted), and the
    event loop thread's other work (the streams' consumers, asyncio)."""
    spans = [k for k in SPANS if k not in ("model", "hop", "loop")] + ["event loop"]
    head = "| path | rows | " + " | ".join(spans) + " | sum |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        cpu = r["cpu_ms"]
        cells = [f"{cpu[k]:.3f}" for k in spans]
        lines.append(f"| {r['path']} | {r['rows']} | " + " | ".join(cells) + f" | {sum(cpu[k] for k in spans):.3f} |")
    return "\n".join(lines)


def gpu_kernels(events: Any, steps: int) -> dict[str, Any]:
    """The GPU's time a step by kernel, from a torch profiler's `events` over `steps` steps (on CUDA: the
    kernels a step's graph replays and those launched eagerly): ``{"steps", "us_a_step", "kernels": [{"name",
    "calls_a_step", "us_a_step"}, ...]}``, the most time first (none on a CPU)."""
    from torch.autograd import DeviceType

    totals: dict[str, list[float]] = {}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        entry = totals.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us()  # (the kernel's own span on the GPU)
    steps = max(steps, 1)
    kernels = [
        {"name": name, "calls_a_step": calls / steps, "us_a_step": round(us / steps, 2)}
        for name, (calls, us) in sorted(totals.items(), key=lambda item: -item[1][1])
    ]
    return {"steps": steps, "us_a_step": round(sum(k["us_a_step"] for k in kernels), 2), "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="a model directory (default: the tests' tiny Llama)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (there the model's span is its launches)")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a shape's config alone)")
    parser.add_argument("--quantize", help="fp8: the weights in fp8, made at load (as `lmiserve serve --quantize`)")
    parser.add_argument("--rows", default="1,32,128")
    parser.add_argument("--paths", default="fast,generic")
    parser.add_argument("--steps", type=int, default=100, help="decode steps measured per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--no-drain", action="store_true", help="also each path at the largest row count, undrained")
    parser.add_argument(
        "--compare-before",
        type=int,
        default=0,
        metavar="N",
        help="N pairs of runs at the largest row count: as before issue #39's host fixes, then as now",
    )
    parser.add_argument(
        "--before-scheduler",
        type=Path,
        help="an earlier engine/core/block_scheduler.py (git show REF:PATH > FILE): its planning in the before runs",
    )
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        metavar="P",
        help="also each row count with prompts of P tokens joining: the steps that carry one (eager on CUDA)",
    )
    parser.add_argument(
        "--graph-pick", action="store_true", help="greedy picks in flight as a CUDA graph's (a GPU's host side)"
    )
    parser.add_argument(
        "--top-n-rows", type=int, default=0, metavar="K", help="K of the rows ask for the top 5 tokens a token"
    )
    parser.add_argument(
        "--penalty-rows", type=int, default=0, metavar="K", help="K of the rows ask for a repetition penalty"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile and torch profiler of the largest row count")
    parser.add_argument("--out", type=Path, help="a directory for summary.json, summary.md and the profiles")
    args = parser.parse_args()

    from lmiserve.core import threads

    # as `lmiserve serve` does before torch is imported: the thread count, and OpenMP's bounded spin
    wait = threads.prepare_environment(threads.choose(None)).wait_policy
    import torch

    if args.before_scheduler is not None:
        BEFORE["schedule_running"] = load_function(args.before_scheduler, "BlockScheduler", "_schedule_running")

    from lmiserve.models.load import load_causal_lm

    with ExitStack() as stack:
        model_dir = args.model_id
        if model_dir is None:
            from helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"))
        loaded = load_causal_lm(
            model_dir, dtype=args.dtype, device=args.device, load_format=args.load_format, quantize=args.quantize
        )
        rows_list = [int(r) for r in args.rows.split(",")]
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        results = []

        def run(path: str, rows: int, **options: Any) -> None:
            options.setdefault("graph_pick", args.graph_pick)
            options.setdefault("top_n_rows", args.top_n_rows)
            options.setdefault("penalty_rows", args.penalty_rows)
            result = asyncio.run(measure(loaded, path, rows, args.steps, args.warmup, None, **options))
            print(json.dumps(result), flush=True)
            results.append(result)

        load_before = os.getloadavg()
        for path in args.paths.split(","):
            for rows in rows_list:
                run(path, rows)
                if args.mixed:
                    run(path, rows, mixed=args.mixed)
            for _ in range(args.compare_before):  # after and before in turns, so drift hits both alike
                run(path, max(rows_list), before=True)
                run(path, max(rows_list))
            if args.no_drain:
                run(path, max(rows_list), drain=False)
            if args.profile and args.out is not None:  # a run of its own: the profilers slow what they watch
                asyncio.run(measure(loaded, path, max(rows_list), min(args.steps, 20), args.warmup, args.out))
                if args.mixed:  # and one of the steps that carry a prompt (torch-<path>-<rows>-mixed*.txt)
                    asyncio.run(
                        measure(
                            loaded, path, max(rows_list), min(args.steps, 20), args.warmup, args.out, mixed=args.mixed
                        )
                    )
    from machine import cpu_model

    cpu = cpu_model()
    env = {
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "openmp_wait": wait,
        "python": platform.python_version(),
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
    }
    summary = (
        table(results)
        + "\n\nCPU time of the host spans (ms a step, the thread that runs each):\n\n"
        + cpu_table(results)
    )
    print(summary)
    if args.out is not None:
        (args.out / "summary.json").write_text(json.dumps({"env": env, "argv": sys.argv, "results": results}, indent=1))
        (args.out / "summary.md").write_text(f"{env}\n\n{summary}\n")


if __name__ == "__main__":
    main()
