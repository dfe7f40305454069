"""Concurrent streams of the bundled SmolLM2-135M-Instruct through lmiserve's engine on this CPU (issue #39,
2026-11-30): the step's tokens/s with every stream decoding, greedy and sampled (temperature 0.7 with top_p
0.9; temperature 1.0), as `lmiserve serve` runs it (the engine's own thread settings).

    PYTHONPATH=. python benchmarks/results/issue39-sampled-syncs-2026-11-30/sampled_streams.py [--streams 1,32,128]

Each level starts N requests of --tokens tokens (EOS ignored) at once and counts the tokens delivered
between the moment the last stream has its first token and the moment the first stream ends (all N
decoding: the prompts' prefill is left out), the best of --rounds.
"""

import argparse
import asyncio
import time

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.models.bundled import bundled_model_path
from lmiserve.models.load import load_causal_lm

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--tokens", type=int, default=48)
parser.add_argument("--streams", default="1,32,128")
parser.add_argument("--kinds", default="greedy,top_p,temperature")
args = parser.parse_args()
loaded = load_causal_lm(bundled_model_path(), dtype="fp32", device="cpu")
KINDS = {
    "greedy": {},
    "top_p": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    "temperature": {"do_sample": True, "temperature": 1.0},
}


async def level(engine, streams: int, extra: dict, seed: int) -> float:
    stamps: list[list[float]] = [[] for _ in range(streams)]

    async def one(i: int) -> None:
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos_token=True, seed=seed * 1000 + i, **extra)
        prompt = f"Write a short story about lighthouse keeper number {i}."
        async for event in engine.generate(GenerationRequest(prompt, params)):
            if event.token is not None:
                stamps[i].append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(streams)))
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    tokens = sum(sum(1 for t in s if start < t <= end) for s in stamps)
    return tokens / (end - start) if end > start else float("nan")


async def main() -> None:
    engine = create_engine(loaded, EngineConfig(max_running=max(int(n) for n in args.streams.split(","))))
    engine.start()
    try:
        for streams in (int(n) for n in args.streams.split(",")):
            for name in args.kinds.split(","):
                best = max([await level(engine, streams, KINDS[name], r) for r in range(args.rounds)])
                print(f"{streams:4d} streams, {name:12s}: {best:7.1f} tokens/s (best of {args.rounds})", flush=True)
    finally:
        await engine.stop()


asyncio.run(main())
