"""One sampled stream of the bundled SmolLM2-135M-Instruct through lmiserve's engine (issue #39, 2026-11-30):
tokens/s of 128 tokens (EOS ignored), greedy and sampled (temperature 0.7, top_p 0.9; temperature 1.0), the
best of `--rounds`, on this machine's CPU as `lmiserve serve` runs it (the engine's own thread settings).

    PYTHONPATH=. python benchmarks/results/issue39-sampled-rows-2026-11-30/sampled_stream.py [--rounds 3]
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
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--tokens", type=int, default=128)
args = parser.parse_args()
loaded = load_causal_lm(bundled_model_path(), dtype="fp32", device="cpu")
kinds = {
    "greedy": {},
    "temperature 0.7, top_p 0.9": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    "temperature 1.0": {"do_sample": True, "temperature": 1.0},
}


async def main() -> None:
    engine = create_engine(loaded, EngineConfig())
    engine.start()
    try:
        prompt = "Write a short story about a lighthouse keeper."
        for name, extra in kinds.items():
            best = 0.0
            for round_ in range(args.rounds):
                params = SamplingParams(max_new_tokens=args.tokens, ignore_eos_token=True, seed=round_, **extra)
                start = time.perf_counter()
                tokens = [e async for e in engine.generate(GenerationRequest(prompt, params)) if e.token is not None]
                best = max(best, len(tokens) / (time.perf_counter() - start))
            print(f"{name:28s}: {best:6.1f} tokens/s (best of {args.rounds}, {args.tokens} tokens)", flush=True)
    finally:
        await engine.stop()


asyncio.run(main())
