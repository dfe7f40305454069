"""In-process engine micro-benchmark: the engine against the bare transformers forward and `generate`.

    .venv/bin/python benchmarks/engine_throughput.py [--tokens 128] [--concurrency 1,8,32]
        [--paths generic,fast] [--steady 32] [--rss-requests 1000] [--threads N] [--json out.json]

Everything runs in one process on the same model (the bundled SmolLM2 unless --model-id), with the
measurements interleaved per concurrency so the ratios stay meaningful on a busy machine:

- bare: `model(input_ids, past_key_values=DynamicCache, use_cache=True)` in a loop, greedy argmax,
  decode steps only (the model-code ceiling at that batch size);
- generate: static `model.generate` of the same prompts, forced `--tokens` new tokens, prefill included;
- engine/<path>: the AsyncEngine at that concurrency, every request forced to `--tokens` new tokens
  (`ignore_eos_token`), wall time from first submit to last token, prefill included;
  <path> is `generic` (the engine before the fast path: transformers forward over the slot cache,
  one forward per prefill chunk, no per-step prefill bound) or `fast` (today's default);
- every rate also as tokens per CPU-second of this process (`*_per_cpu_s`, `cpu_vs_*`): far less
  sensitive than wall time when other processes share the cores;
- steady: `--steady` closed-loop clients; a new request starts whenever one finishes; inter-token
  latency p50/p99 over requests that joined a running batch;
- rss: resident memory after 10 % of `--rss-requests` short requests and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time

import torch
from greedy_agreement import prompts  # the same prompt set (this folder is on sys.path when run as a script)
from transformers import DynamicCache

from lmiserve.core import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.models import load_causal_lm, resolve_model_path


def prompt_batch(loaded, batch: int) -> torch.Tensor:
    """The prompts as one [batch, L] tensor, cut to the shortest so no padding is needed."""
    ids = [loaded.tokenizer(t).input_ids for t in prompts(batch)]
    length = min(len(i) for i in ids)
    return torch.tensor([i[:length] for i in ids], device=loaded.device)


CPU_RATE: dict[str, float] = {}  # tokens per CPU-second of the last measurement of each kind


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


# ---- references ---------------------------------------------------------------------------------
@torch.inference_mode()
def bare_forward(loaded, batch: int, steps: int) -> float:
    model = loaded.model
    ids = prompt_batch(loaded, batch)
    cache = DynamicCache(config=model.config)
    nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        nxt = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    CPU_RATE["bare"] = batch * steps / (time.process_time() - cpu)
    return batch * steps / (time.perf_counter() - start)


@torch.inference_mode()
def static_generate(loaded, batch: int, tokens: int) -> float:
    ids = prompt_batch(loaded, batch)
    pad = loaded.tokenizer.pad_token_id or next(iter(loaded.eos_token_ids))
    start, cpu = time.perf_counter(), time.process_time()
    out = loaded.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    elapsed = time.perf_counter() - start
    CPU_RATE["generate"] = (out.shape[0] * (out.shape[1] - ids.shape[1])) / (time.process_time() - cpu)
    return (out.shape[0] * (out.shape[1] - ids.shape[1])) / elapsed


# ---- the engine ----------------------------------------------------------------------------------
MODELS: dict = {}  # path -> the LoadedModel it serves (generic: the pristine reference copy)


def engine_for(loaded, path: str, running: int, prefill_tokens: int | None):
    """generic = the engine as it was before the fast path (transformers forward, per-chunk prefill
    forwards, no per-step prefill bound); fast = today's default."""
    if path == "generic":
        config = EngineConfig(max_running=running, fast_path=False, prefill_floor=None)
    else:
        config = EngineConfig(max_running=running)
    if prefill_tokens is not None:
        config.max_prefill_tokens = prefill_tokens
    return create_engine(MODELS.get(path, loaded), config)


async def _stream(engine, text: str, tokens: int) -> list[float]:
    """Arrival times of each token of one forced-length request (the submit time first)."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
    times = [time.perf_counter()]
    async for event in engine.generate(GenerationRequest(text, params)):
        if event.token is not None:
            times.append(time.perf_counter())
    return times


async def engine_wave(loaded, path: str, concurrency: int, tokens: int, prefill_tokens) -> dict:
    engine = engine_for(loaded, path, concurrency, prefill_tokens)
    engine.start()
    try:
        await _stream(engine, "warm up", 2)
        start, cpu = time.perf_counter(), time.process_time()
        runs = await asyncio.gather(*(_stream(engine, t, tokens) for t in prompts(concurrency)))
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        await engine.stop()
    generated = sum(len(r) - 1 for r in runs)
    ttft = [r[1] - r[0] for r in runs]
    itl = [b - a for r in runs for a, b in itertools.pairwise(r[1:])]
    return {
        "tok_s": generated / elapsed,
        "tok_per_cpu_s": generated / cpu,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_max": max(ttft),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
    }


async def steady_load(loaded, path: str, clients: int, tokens: int, requests: int, prefill_tokens) -> dict:
    """Closed loop: each client starts a new request when its previous one ends; lengths vary."""
    engine = engine_for(loaded, path, clients, prefill_tokens)
    steps: list[tuple[bool, float, float]] = []  # (had prefill, wall s, worker-thread CPU s) per step
    execute = engine.runner.execute

    def timed(plan):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return execute(plan)
        finally:
            steps.append((bool(plan.prefill), time.perf_counter() - start, time.thread_time() - cpu))

    engine.runner.execute = timed
    engine.start()
    rng = random.Random(0)
    texts = prompts(requests)
    lengths = [rng.randint(tokens // 2, tokens + tokens // 2) for _ in range(requests)]
    queue = list(range(requests))
    joined: list[list[float]] = []

    async def client():
        while queue:
            i = queue.pop(0)
            times = await _stream(engine, texts[i], lengths[i])
            if i >= clients:  # joined a batch that was already running
                joined.append(times)

    try:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    finally:
        await engine.stop()
    itl = [b - a for r in joined for a, b in itertools.pairwise(r[1:])]
    ttft = [r[1] - r[0] for r in joined]
    decode_cpu = [c for p, _, c in steps if not p]
    prefill_cpu = [c for p, _, c in steps if p]
    all_cpu = [c for _, _, c in steps]
    return {
        "tok_s": sum(lengths) / elapsed,
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
        "itl_max": max(itl),
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        # step cost in CPU time of the worker thread: what a stream waits per token, without
        # the other processes' share of the cores
        "steps": len(steps),
        "steps_with_prefill": len(prefill_cpu),
        "step_cpu_p50": pct(all_cpu, 0.5),
        "step_cpu_p99": pct(all_cpu, 0.99),
        "step_cpu_p99_over_p50": pct(all_cpu, 0.99) / pct(all_cpu, 0.5),
        "decode_step_cpu_p50": pct(decode_cpu, 0.5),
        "prefill_step_cpu_p50": pct(prefill_cpu, 0.5),
        "prefill_step_cpu_max": max(prefill_cpu, default=float("nan")),
    }


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def rss_run(loaded, path: str, requests: int, concurrency: int, prefill_tokens) -> dict:
    engine = engine_for(loaded, path, concurrency, prefill_tokens)
    engine.start()
    gate = asyncio.Semaphore(concurrency)
    texts = prompts(requests)
    done = 0
    marks: dict[str, float] = {}

    async def one(i: int):
        nonlocal done
        async with gate:
            params = SamplingParams(max_new_tokens=4 + i % 9, ignore_eos_token=True)
            async for _ in engine.generate(GenerationRequest(texts[i] * (1 + i % 3), params)):
                pass
            done += 1
            if done == max(1, requests // 10):
                marks["after_10pct"] = rss_mb()

    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await engine.stop()
    marks["end"] = rss_mb()
    marks["growth"] = marks["end"] / marks["after_10pct"] - 1
    return marks


# ---- report --------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--paths", default="generic,fast")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="max_prefill_tokens (default: engine's)")
    parser.add_argument("--steady", type=int, default=32, help="clients of the steady-load run (0 = skip)")
    parser.add_argument("--steady-requests", type=int, default=96)
    parser.add_argument("--rss-requests", type=int, default=1000, help="0 = skip")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = resolve_model_path(args.model_id, None, None)
    # the fast path re-lays out the weights it serves (faster GEMMs for transformers too): the
    # references run on a pristine copy so they measure transformers as users get it
    reference = load_causal_lm(path, dtype="auto", device="auto")
    loaded = load_causal_lm(path, dtype="auto", device="auto")
    MODELS["generic"] = reference
    paths = [p for p in args.paths.split(",") if p]
    report: dict = {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "tokens": args.tokens,
        "concurrency": {},
    }
    bare_forward(reference, 1, 4)  # warm up kernels
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        row: dict = {
            "bare": bare_forward(reference, c, args.tokens),
            "generate": static_generate(reference, c, args.tokens),
        }
        row["bare_per_cpu_s"], row["generate_per_cpu_s"] = CPU_RATE["bare"], CPU_RATE["generate"]
        for path in paths:
            row[path] = asyncio.run(engine_wave(loaded, path, c, args.tokens, args.prefill_tokens))
            row[path]["vs_bare"] = row[path]["tok_s"] / row["bare"]
            row[path]["vs_generate"] = row[path]["tok_s"] / row["generate"]
            row[path]["cpu_vs_bare"] = row[path]["tok_per_cpu_s"] / row["bare_per_cpu_s"]
            row[path]["cpu_vs_generate"] = row[path]["tok_per_cpu_s"] / row["generate_per_cpu_s"]
        report["concurrency"][c] = row
        print(f"c={c}: " + json.dumps(row), flush=True)
    if args.steady:
        report["steady"] = {}
        for path in paths:
            s = asyncio.run(
                steady_load(loaded, path, args.steady, args.tokens, args.steady_requests, args.prefill_tokens)
            )
            s["p99_over_p50"] = s["itl_p99"] / s["itl_p50"]
            report["steady"][path] = s
            print(f"steady {path}: " + json.dumps(s), flush=True)
    if args.rss_requests:
        report["rss"] = {}
        for path in paths:
            report["rss"][path] = asyncio.run(rss_run(loaded, path, args.rss_requests, 32, args.prefill_tokens))
            print(f"rss {path}: " + json.dumps(report["rss"][path]), flush=True)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
