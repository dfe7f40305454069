"""How many decode steps with LoRA adapters chain on the device under overlap scheduling (issue #39).

    PYTHONPATH=<tree> python lora_chain.py [--streams 12] [--adapters 2] [--new-tokens 32] [--out FILE]

The tests' tiny Llama with `--adapters` random adapters (rank 16, every linear; lmiserve/models/lora_demo.py),
`max_loras` = that count; `--streams` greedy streams at once, naming the adapters in turn with one in
(adapters + 1) on the base model. The decode graphs are the tests' (tests/helpers/decode_graphs.py): on a CPU
the same fixed buffers run without a capture, so what is counted is what a GPU would replay and chain, not
its time. Two engines: serial (`async_scheduling` off), then overlapped. Reported: the steps, the graph
steps, the graph steps with adapters, those chained from the step in flight (their rows' inputs read on the
device), the steps planned ahead, and whether the overlapped tokens are the serial ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on a CPU, as the tests run them

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPTS = ["Hello there, how are", "def add(a, b):", "The quick brown fox jumps", "Numbers like 1, 2, 3"]


async def serve(loaded: Any, adapters: dict[str, Path], streams: int, tokens: int, overlap: bool) -> tuple[Any, list[list[int]]]:
    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine
    from lmiserve.engine.lora.registry import LoraLimits

    config = EngineConfig(
        lora=LoraLimits(max_loras=len(adapters)), cpu_autotune=False, max_running=streams,
        max_prefill_tokens=64, async_scheduling=overlap,
    )
    engine = create_engine(loaded, config)
    for name, path in adapters.items():
        await asyncio.to_thread(engine.adapters.register, name, path)
    names = [None, *adapters]

    async def one(i: int) -> list[int]:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
        request = GenerationRequest(PROMPTS[i % len(PROMPTS)], params, adapter=names[i % len(names)])
        return [e.token.id async for e in engine.generate(request) if e.token is not None]

    engine.start()
    try:
        return engine, await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from helpers.decode_graphs import graphs_on_the_test_device
    from helpers.tiny_model import build_tiny_model_dir
    from machine import cpu_model

    from lmiserve.models.load import load_causal_lm
    from lmiserve.models.lora_demo import LORA_TARGETS, make_adapters

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "tiny")
        adapters = make_adapters(Path(model_dir), Path(tmp) / "adapters", args.adapters, 16, LORA_TARGETS["all"])
        loaded = load_causal_lm(str(model_dir), dtype="fp32", device="cpu")
        report: dict[str, Any] = {"cpu": cpu_model(), "argv": sys.argv, "tree": str(ROOT)}
        tokens = {}
        for overlap in (False, True):
            with pytest.MonkeyPatch.context() as patch:
                record = graphs_on_the_test_device(patch)
                engine, tokens[overlap] = asyncio.run(serve(loaded, adapters, args.streams, args.new_tokens, overlap))
            with_lora = sum(1 for _, n in record.steps if n)
            report["overlapped" if overlap else "serial"] = {
                "steps": engine.steps,
                "graph_steps": len(record.steps),
                "graph_steps_with_adapters": with_lora,
                "chained": record.chained,
                "chained_with_adapters": getattr(record, "chained_lora", None),
                "steps_planned_ahead": engine.steps_ahead,
            }
        report["same_tokens"] = tokens[False] == tokens[True]
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
