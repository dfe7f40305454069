"""A decode step's time over each KV pool dtype at long contexts, on a CPU, in one process: the fast forward's
steps of a few rows whose contexts fill an fp32, bf16 or fp8 pool, interleaved so that a busy neighbour hits
all of them alike.

    .venv/bin/python benchmarks/kv_pool_steps.py [--model-id DIR] [--dtype int4] [--kv-dtypes auto,bfloat16,fp8_e4m3]
        [--rows 1,4] [--contexts 256,2048] [--steps 30] [--json FILE]

Each row's context is `--contexts` positions of random keys and values (as the pool stores them: rounded to bf16,
quantized to fp8), in its own blocks; a step decodes one token a row at the context's end (the same position
each step, so the context stays the same length). For a model whose layers run through `q4_decode`'s packed
kernels (``--dtype int4``, the default) each pool is timed twice: ``lean``, the one-call attention on the qkv
buffer's views (`CpuKernelBackend.decode_kernel`), and ``call``, the backend's `forward` (its tensors and views a
layer), which was the path over bf16 and fp8 pools before 2026-12-07 22:00 UTC. Prints one JSON report: median and
best step per (pool, way), tokens/s from the median, the CPU and the load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dtype_decode import timed_in_turn  # noqa: E402
from lmiserve.core.cpu_info import cpu_info  # noqa: E402
from lmiserve.engine.attention import kv_quant  # noqa: E402
from lmiserve.engine.attention.paged import paged_cache  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs  # noqa: E402
from lmiserve.models import load_causal_lm, resolve_model_path  # noqa: E402

BLOCK_SIZE = 16


def pool_forward(model: torch.nn.Module, kv: str, rows: int, context: int) -> FastLlama:
    """The fast forward over a pool of `kv` holding `rows` contexts of `context` random positions each."""
    per_row = -(-(context + 1) // BLOCK_SIZE)
    cache = paged_cache(model, rows * per_row, BLOCK_SIZE, kv_quant.KvFormat(kv))
    gen = torch.Generator().manual_seed(0)
    for pool in (*cache.keys, *cache.values):
        pool.copy_(kv_quant.quantize(torch.randn(pool.shape, generator=gen), pool.dtype))
    return FastLlama(model, cache, 2048)


def step(fast: FastLlama, rows: int, context: int, lean: bool):
    """One decode step of `rows` rows at position `context`, through the one-call attention or not."""
    per_row = -(-(context + 1) // BLOCK_SIZE)
    tables = [[row * per_row + j for j in range(per_row)] for row in range(rows)]
    inputs = StepInputs([5 + i for i in range(rows)], [context] * rows, tables, keep=list(range(rows)))
    attention = fast.attention
    decode_kernel = type(attention).decode_kernel if hasattr(attention, "decode_kernel") else None

    def run() -> None:
        if decode_kernel is not None:  # the backend's own method, or none: its `forward` a layer
            attention.decode_kernel = (lambda meta: decode_kernel(attention, meta)) if lean else (lambda meta: None)
        fast.forward(inputs)

    return run


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--kv-dtypes", default="auto,bfloat16,fp8_e4m3")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = load_causal_lm(resolve_model_path(args.model_id, None, None), dtype=args.dtype, device="cpu").model
    report: dict[str, object] = {
        "cpu": cpu_info().as_dict(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "load_average_before": os.getloadavg(),
        "levels": {},
    }
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            steps = {}
            for kv in args.kv_dtypes.split(","):
                fast = pool_forward(model, kv, rows, context)
                ways = ("lean", "call") if fast.packed is not None else ("call",)
                for way in ways:
                    steps[f"{kv} {way}"] = step(fast, rows, context, way == "lean")
            entry = {"load_average": os.getloadavg(), **timed_in_turn(steps, args.steps, rows)}
            report["levels"][f"{rows} rows x {context}"] = entry  # type: ignore[index]
            print(json.dumps({f"{rows} rows x {context}": entry}), flush=True)
    report["load_average_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
