"""The prefix cache, in process on the bundled model: multi-turn chat TTFT and no-shared-prefix
throughput with the cache on and off, interleaved in one run; RSS over a longer chat loop.

    .venv/bin/python benchmarks/prefix_cache.py [--reps 3] [--conversations 4] [--turns 6]
        [--answer-tokens 48] [--concurrency 1] [--throughput-requests 16] [--soak-requests 320]
        [--soak-cache-size 64MiB] [--json out.json]

- chat: `--conversations` conversations, run `--concurrency` at a time, each of `--turns` turns; every
  turn resends the whole history (a ~140-token system prompt shared by all, then the user questions
  and the model's own answers, greedy, forced to `--answer-tokens` tokens) through the model's chat
  template. TTFT = submit to first token, in process. Reported per turn number, and p50 of turns >= 3.
- throughput: `--throughput-requests` prompts that share no prefix (a distinct number first), 8 at a
  time, 64 forced tokens each; tokens/s of wall time and per CPU-second of this process.
- Every repetition builds a fresh engine per mode (an empty cache) and runs on and off in alternating
  order (on/off, off/on, ...) so machine load hits both alike; ratios are on/off of the medians.
- soak: `--soak-requests` chat turns (conversations of 8 turns, 8 at a time) with the cache on and
  limited to `--soak-cache-size`, RSS after each 10 % (the cache fills, then evicts: RSS must level off).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import time

import torch
from machine import cpu_model  # benchmarks/machine.py: the script's folder is on sys.path

from lmiserve.config.settings import Settings
from lmiserve.core import GenerationRequest, SamplingParams
from lmiserve.engine import torch_thread
from lmiserve.engine.factory import create_engine
from lmiserve.models import load_causal_lm, resolve_model_path
from lmiserve.models.compose import engine_config

SYSTEM = (
    "You are a friendly and knowledgeable assistant for a small travel agency. Answer the customer's "
    "questions about destinations, transport, weather, food and local customs. Keep every answer short: "
    "two or three sentences. If you do not know something, say so plainly instead of guessing. Prefer "
    "practical advice: opening hours, prices in the local currency, how to get from the airport to the "
    "city centre, which districts are pleasant to stay in, and what to avoid. Be polite, never pushy, and "
    "do not recommend specific hotels or companies by name. Use metric units and the 24-hour clock. When "
    "the customer asks about a country, mention one local dish they should try."
)
QUESTIONS = [
    "I am planning a trip to Lisbon in March. What is the weather like then?",
    "How do I get from the airport to the city centre?",
    "Which district would you suggest for a first visit?",
    "What local dish should I try?",
    "Is it easy to visit Sintra as a day trip?",
    "How much does a coffee usually cost?",
    "Are the trams worth it, or should I walk?",
    "What should I avoid doing as a tourist?",
    "Can you suggest a nice viewpoint for the sunset?",
    "Is it safe to walk around at night?",
    "What is a good souvenir to bring back home?",
    "Do I need to tip in restaurants?",
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def make_engine(loaded, cache_bytes: int, max_running: int = 32):
    """An engine configured as `lmiserve serve` configures it (autotuned CPU kernels, the server's
    prefill policy), with this prefix cache budget. Made on the torch thread, as all torch work here:
    a second thread running torch ops makes every step ~1.6x slower (engine/torch_thread.py)."""
    config = dataclasses.replace(engine_config(Settings()), max_running=max_running, prefix_cache_bytes=cache_bytes)
    return await torch_thread.run(create_engine, loaded, config)


async def conversation(engine, tokenizer, number: int, turns: int, tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(number + turn) % len(QUESTIONS)]})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
        start, first, finish, ids = time.perf_counter(), None, None, []
        async for event in engine.generate(GenerationRequest(prompt, params)):
            if event.token is not None:
                first = first if first is not None else time.perf_counter() - start
                ids.append(event.token.id)
            finish = event.finish or finish
        assert finish is not None and first is not None
        out.append(
            {
                "turn": turn + 1,
                "ttft": first,
                "prompt": finish.prompt_tokens,
                "cached": finish.cached_tokens,
                "ids": ids,
            }
        )
        messages.append({"role": "assistant", "content": finish.generated_text})
    return out


async def chat(loaded, cache_bytes: int, args) -> list[dict]:
    engine = await make_engine(loaded, cache_bytes)
    engine.start()
    try:
        results: list[dict] = []
        numbers = list(range(args.conversations))
        for i in range(0, len(numbers), args.concurrency):
            group = numbers[i : i + args.concurrency]
            done = await asyncio.gather(
                *(conversation(engine, loaded.tokenizer, n, args.turns, args.answer_tokens) for n in group)
            )
            for n, turns in zip(group, done):
                results += [{**t, "conversation": n} for t in turns]
        return results
    finally:
        await engine.stop()


async def throughput(loaded, cache_bytes: int, requests: int, rep: int) -> tuple[float, float]:
    engine = await make_engine(loaded, cache_bytes)
    engine.start()
    topics = ["the sea", "gravity", "a city at night", "machine learning", "the moon", "coffee", "trains"]
    texts = [
        f"{(rep * 1000 + i) * 7919 % 100003} - Write a few sentences about {topics[i % len(topics)]}, "
        f"as if to a friend who has never heard of it."
        for i in range(requests)
    ]
    params = SamplingParams(max_new_tokens=64, ignore_eos_token=True)

    async def one(text: str) -> int:
        return len([e async for e in engine.generate(GenerationRequest(text, params)) if e.token is not None])

    try:
        start, cpu, tokens = time.perf_counter(), time.process_time(), 0
        for i in range(0, requests, 8):
            tokens += sum(await asyncio.gather(*(one(t) for t in texts[i : i + 8])))
        return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)
    finally:
        await engine.stop()


async def soak(loaded, cache_bytes: int, requests: int) -> dict:
    engine = await make_engine(loaded, cache_bytes)
    engine.start()
    marks, done = [], 0
    conversations = -(-requests // 8)

    async def client(first: int) -> None:
        nonlocal done
        for number in range(first, conversations, 8):
            for _ in await conversation(engine, loaded.tokenizer, number, 8, 8):
                pass
            done += 8
            marks.append((done, round(rss_mb(), 1), engine.snapshot().prefix_cache_tokens))

    try:
        start_rss = rss_mb()
        await asyncio.gather(*(client(i) for i in range(8)))
        snap = engine.snapshot()
        return {
            "start_rss_mb": round(start_rss, 1),
            "marks": sorted(marks),
            "requests": done,
            "cache_tokens": snap.prefix_cache_tokens,
            "cache_capacity": snap.prefix_cache_capacity,
            "cache_bytes": snap.prefix_cache_bytes,
        }
    finally:
        await engine.stop()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--throughput-requests", type=int, default=16)
    parser.add_argument("--soak-requests", type=int, default=320)
    parser.add_argument("--soak-cache-size", default="64MiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    loaded = await torch_thread.run(
        lambda: load_causal_lm(resolve_model_path(args.model_id), dtype="fp32", device="cpu")
    )
    cache_bytes = engine_config(Settings()).prefix_cache_bytes
    report: dict = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
        "cache_bytes": cache_bytes,
        "args": vars(args),
    }
    print(f"CPU {report['cpu']}, {report['threads']} threads, load {report['load_before']}")
    await chat(loaded, cache_bytes, argparse.Namespace(**{**vars(args), "conversations": 1, "turns": 2}))  # warm up

    ttft: dict[str, list[dict]] = {"on": [], "off": []}
    rates: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    identical = True
    for rep in range(args.reps):
        order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
        runs = {}
        for mode in order:
            runs[mode] = await chat(loaded, cache_bytes if mode == "on" else 0, args)
            ttft[mode] += runs[mode]
            print(f"  rep {rep + 1} chat {mode}: {time.strftime('%H:%M:%S')}", flush=True)
        identical &= [r["ids"] for r in runs["on"]] == [r["ids"] for r in runs["off"]]
        for mode in order:
            rates[mode].append(
                await throughput(loaded, cache_bytes if mode == "on" else 0, args.throughput_requests, rep)
            )
        print(
            f"rep {rep + 1}: chat on/off p50 TTFT turns>=3 "
            f"{pct([r['ttft'] for r in runs['on'] if r['turn'] >= 3], 0.5) * 1000:.0f} / "
            f"{pct([r['ttft'] for r in runs['off'] if r['turn'] >= 3], 0.5) * 1000:.0f} ms; "
            f"throughput on/off {rates['on'][-1][0]:.1f} / {rates['off'][-1][0]:.1f} tok/s",
            flush=True,
        )
    per_turn = {}
    for turn in range(1, args.turns + 1):
        on = [r for r in ttft["on"] if r["turn"] == turn]
        off = [r for r in ttft["off"] if r["turn"] == turn]
        per_turn[turn] = {
            "prompt_tokens": round(statistics.mean(r["prompt"] for r in on)),
            "cached_tokens": round(statistics.mean(r["cached"] for r in on)),
            "ttft_on_ms": round(pct([r["ttft"] for r in on], 0.5) * 1000, 1),
            "ttft_off_ms": round(pct([r["ttft"] for r in off], 0.5) * 1000, 1),
        }
    late_on = pct([r["ttft"] for r in ttft["on"] if r["turn"] >= 3], 0.5)
    late_off = pct([r["ttft"] for r in ttft["off"] if r["turn"] >= 3], 0.5)
    wall_on, wall_off = (statistics.median(r[0] for r in rates[m]) for m in ("on", "off"))
    cpu_on, cpu_off = (statistics.median(r[1] for r in rates[m]) for m in ("on", "off"))
    report.update(
        per_turn=per_turn,
        identical_tokens=identical,
        ttft_p50_turn3plus_ms={
            "on": round(late_on * 1000, 1),
            "off": round(late_off * 1000, 1),
            "ratio": round(late_on / late_off, 3),
        },
        throughput={
            "on_tok_s": round(wall_on, 1),
            "off_tok_s": round(wall_off, 1),
            "ratio": round(wall_on / wall_off, 3),
            "on_tok_per_cpu_s": round(cpu_on, 1),
            "off_tok_per_cpu_s": round(cpu_off, 1),
            "cpu_ratio": round(cpu_on / cpu_off, 3),
            "runs": rates,
        },
    )
    print(json.dumps({k: report[k] for k in ("per_turn", "identical_tokens", "ttft_p50_turn3plus_ms")}, indent=1))
    print(json.dumps({k: v for k, v in report["throughput"].items() if k != "runs"}))
    if args.soak_requests:
        report["soak"] = await soak(
            loaded, int(Settings(prefix_cache_size=args.soak_cache_size).prefix_cache_size), args.soak_requests
        )
        print(json.dumps(report["soak"]))
    report["load_after"] = os.getloadavg()
    print(f"load average after: {report['load_after']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
