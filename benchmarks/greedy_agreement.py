"""Measure how often greedy output of the batched engine equals `model.generate(do_sample=False)`.

    .venv/bin/python benchmarks/greedy_agreement.py [--prompts 48] [--concurrency 16] [--tokens 48]
    .venv/bin/python benchmarks/greedy_agreement.py --dtype bf16   # (or int8) against fp32 and itself

Runs the bundled model (or --model-id DIR) in-process: every prompt through `generate` alone, then
all prompts through the engine at the given concurrency, in the default batched mode and with
batch_invariant=true. Prints the share of sequences that match token for token and, for those
that do not, the first differing position. Batched kernels can break near-ties differently from a
batch of one; batch_invariant=true runs each sequence's forward pass alone and must score 100 %.

With --dtype bf16 or int8: the batched engine in that dtype against `generate` in the same dtype
(greedy parity) and against `generate` in fp32 (how much the dtype changes the output), plus the
share of all tokens that equal fp32's before each sequence's first difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from lmiserve.config import Settings
from lmiserve.core import GenerationRequest, SamplingParams
from lmiserve.models import load_causal_lm, resolve_model_path
from lmiserve.models.compose import build_engine

TOPICS = [
    "the sea",
    "gravity",
    "a city at night",
    "machine learning",
    "the moon",
    "coffee",
    "trains",
    "music",
    "volcanoes",
    "friendship",
    "winter",
    "the internet",
]
TEMPLATES = [
    "Write a short poem about {}.",
    "Explain {} in simple words.",
    "What is interesting about {}?",
    "Tell me a story about {}.",
]


def prompts(count: int) -> list[str]:
    return [TEMPLATES[i % len(TEMPLATES)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]


def reference(loaded, texts: list[str], tokens: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = loaded.tokenizer(text, return_tensors="pt").input_ids
            gen = loaded.model.generate(ids, max_new_tokens=tokens, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


async def served(loaded, texts: list[str], tokens: int, concurrency: int, batch_invariant: bool) -> list[list[int]]:
    engine = build_engine(loaded, Settings(max_rolling_batch_size=concurrency, batch_invariant=batch_invariant))
    engine.start()
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str) -> list[int]:
        async with gate:
            req = GenerationRequest(text, SamplingParams(max_new_tokens=tokens))
            return [e.token.id async for e in engine.generate(req) if e.token is not None]

    try:
        return await asyncio.gather(*(one(t) for t in texts))
    finally:
        await engine.stop()


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"prompt": i, "first_difference_at_token": first})
    return {
        "sequences": len(ref),
        "equal": len(ref) - len(mismatches),
        "rate": (len(ref) - len(mismatches)) / len(ref),
        "mismatches": mismatches,
    }


def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of reference tokens matched before each sequence's first difference."""
    same = 0
    for a, b in zip(ref, got):
        same += next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return round(same / max(1, sum(len(a) for a in ref)), 4)


def against_fp32(args: argparse.Namespace) -> None:
    path = resolve_model_path(args.model_id, None, None)
    texts = prompts(args.prompts)
    fp32 = load_causal_lm(path, dtype="fp32", device="cpu")
    t0 = time.time()
    ref32 = reference(fp32, texts, args.tokens)
    report = {
        "model": str(path),
        "prompts": args.prompts,
        "concurrency": args.concurrency,
        "new_tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "fp32_generate_seconds": round(time.time() - t0, 1),
    }
    del fp32
    for dtype in args.dtype.split(","):
        loaded = load_causal_lm(path, dtype=dtype, device="cpu")
        t0 = time.time()
        same = reference(loaded, texts, args.tokens)
        part = {"generate_seconds": round(time.time() - t0, 1)}
        t0 = time.time()
        got = asyncio.run(served(loaded, texts, args.tokens, args.concurrency, False))
        part["engine_seconds"] = round(time.time() - t0, 1)
        part["engine_vs_generate_same_dtype"] = compare(same, got)
        part["engine_vs_fp32_generate"] = {**compare(ref32, got), "token_agreement": agreement(ref32, got)}
        part["generate_vs_fp32_generate"] = {**compare(ref32, same), "token_agreement": agreement(ref32, same)}
        report[dtype] = part
        print(json.dumps({dtype: part}), flush=True)
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--dtype", default="fp32", help="fp32 (default), or bf16, int8, bf16,int8: compared with fp32 too"
    )
    args = parser.parse_args()
    if args.dtype != "fp32":
        against_fp32(args)
        return
    loaded = load_causal_lm(resolve_model_path(args.model_id, None, None), dtype="fp32", device="auto")
    texts = prompts(args.prompts)
    t0 = time.time()
    ref = reference(loaded, texts, args.tokens)
    report = {
        "model": str(loaded.path),
        "concurrency": args.concurrency,
        "new_tokens": args.tokens,
        "generate_seconds": round(time.time() - t0, 1),
    }
    for mode, invariant in (("batched", False), ("batch_invariant", True)):
        t0 = time.time()
        got = asyncio.run(served(loaded, texts, args.tokens, args.concurrency, invariant))
        report[mode] = {**compare(ref, got), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
