"""Tensor parallelism against one device: greedy agreement and decode speed, in one run.

    python benchmarks/tp_parity.py [--model-id DIR] [-o load_format=dummy] [--device cpu|cuda]
                                   [--degree N] [--prompts K] [--max-new-tokens T] [--json FILE]

The same prompts run on the engine of one device (the model in this process) and on the engine over
`--degree` tensor-parallel workers (engine/executors/tensor_parallel.py), one after the other, each alone on the
machine: greedy tokens are compared prompt by prompt (how many agree in full, and the first position
where any other differs) and the decode throughput of the concurrent batch is reported for both.
Without --model-id: the tests' tiny Llama model (tests/helpers/tiny_model.py), built in a temporary
folder. On a machine with one GPU `--degree 1` still runs the workers' path (NCCL, a spawned worker).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List of prime numbers: 2, 3, 5,",
    "In 1969, the first person to walk on the moon was",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
)


async def _generate(
    engine: Any,
    prompts: list[str],
    max_new_tokens: int,
    adapters: list[str | None] | None = None,
    sampled: bool = False,
    top_p: float = 1.0,
    top_n: int = 0,
    stamps: list[list[float]] | None = None,
) -> tuple[list[list[int]], float]:
    """Greedy tokens of each prompt (on the LoRA adapter `adapters` names for it, None: the base model),
    all at once after one warm-up request, and the seconds they took. `sampled`: drawn at temperature 1.0
    instead (OpenAI's default), with `top_p`, each prompt seeded by its place; `top_n`: each token's top-N too
    (OpenAI's top_logprobs); `stamps`: given, each prompt's token times (`time.perf_counter`) appended to it."""
    from lmiserve.core.request import GenerationRequest, SamplingParams

    seeds = iter(range(1, 1 << 30))

    async def one(prompt: str, adapter: str | None = None, times: list[float] | None = None) -> list[int]:
        sampling: dict[str, Any] = {"do_sample": False}
        if sampled:
            sampling = {"do_sample": True, "temperature": 1.0, "top_p": top_p, "seed": next(seeds)}
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True, top_n_tokens=top_n, **sampling)
        tokens = []
        async for event in engine.generate(GenerationRequest(prompt=prompt, params=params, adapter=adapter)):
            if event.token is not None:
                tokens.append(event.token.id)
                if times is not None:
                    times.append(time.perf_counter())
        return tokens

    engine.start()
    try:
        await one("warm up")
        start = time.perf_counter()
        times: list[list[float]] = [[] for _ in prompts]
        if stamps is not None:
            stamps.extend(times)
        on = adapters or [None] * len(prompts)
        outputs = await asyncio.gather(*(one(p, a, t) for p, a, t in zip(prompts, on, times, strict=True)))
        return list(outputs), time.perf_counter() - start
    finally:
        await engine.stop()


def run(model_dir: str, options: dict[str, str], device: str, degree: int, prompts: list[str], tokens: int) -> dict:
    import torch

    from lmiserve.config import Settings
    from lmiserve.models.compose import build_engine, build_tensor_parallel_engine
    from lmiserve.models.load import load_causal_lm, load_model_shell

    base = {"model_id": model_dir, "device": device, **options}
    one = Settings.from_options(base)
    # a dummy model loaded on the CPU, then moved, as a worker loads it: the same random weights; a checkpoint on the
    # device (a quantized checkpoint's layers are made for it: fp8 products on a GPU that has them)
    dummy = one.load_format == "dummy"
    loaded = load_causal_lm(
        model_dir, dtype=one.dtype, device="cpu" if dummy else device, load_format=one.load_format,
        quantize=one.quantize,
    )  # fmt: skip
    if dummy and device != "cpu":
        loaded.model.to(device)
        loaded = dataclasses.replace(loaded, device=torch.device(device))
    single, single_s = asyncio.run(_generate(build_engine(loaded, one), prompts, tokens))
    del loaded
    gc.collect()
    if device != "cpu":  # the workers are other processes: give them this one's cached memory
        torch.cuda.empty_cache()
    many = Settings.from_options({**base, "tensor_parallel_degree": str(degree)})
    shell = load_model_shell(model_dir, dtype=many.dtype, device=device)
    parallel, parallel_s = asyncio.run(_generate(build_tensor_parallel_engine(shell, many, degree), prompts, tokens))
    first_difference = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(single, parallel)
    ]
    generated = sum(len(x) for x in single)
    return {
        "device": device,
        "degree": degree,
        "prompts": len(prompts),
        "max_new_tokens": tokens,
        "identical": sum(x == y for x, y in zip(single, parallel)),
        "first_difference": first_difference,
        "one_device_tokens_per_s": generated / single_s,
        "parallel_tokens_per_s": sum(len(y) for y in parallel) / parallel_s,
        "ratio": (sum(len(y) for y in parallel) / parallel_s) / (generated / single_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", help="model directory (default: the tests' tiny model)")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--degree", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="concurrent prompts (the batch)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    options = dict(item.split("=", 1) for item in args.options)
    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_id
        if model_dir is None:
            from tests.helpers.tiny_model import build_tiny_model_dir

            model_dir = str(build_tiny_model_dir(Path(tmp) / "tiny"))
        report = run(model_dir, options, args.device, args.degree, prompts, args.max_new_tokens)
    write_report(report, args.json)
    return 0


def write_report(report: dict[str, Any], path: Path | None) -> None:
    """Print the report as JSON, and write it to `path` too when given."""
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if path is not None:
        path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
