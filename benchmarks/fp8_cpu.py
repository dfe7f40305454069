"""fp8 checkpoints on a CPU: kept fp8 on the q8 kernel (`engine/model/cpu_codes.py`, `fp8_layer`) against
de-quantized to fp32 at load as before 2026-12-07.

    python benchmarks/fp8_cpu.py [--format fp8-channel] [--hidden 2048] [--intermediate 8192] [--layers 4]
                                 [--steps 32] [--rows 1,8] [--prompt 128] [--json FILE]

A Llama of a Llama 3.2 1B's layer shape (hidden 2048, intermediate 8192, 32 heads of 64, 8 KV heads; `--layers` of
them) with random weights is written as an fp8 checkpoint (`--format`: ``fp8-channel``, compressed-tensors' scale a
channel as RedHatAI's releases; ``fp8-tensor``; ``fp8-block``, blocks of 128 x 128 as Qwen3's and DeepSeek's ``-FP8``
releases). It is loaded as the server loads it (`load_causal_lm`, fp32 on the CPU), and again as before (every layer
linear de-quantized to fp32). For each it reports the layer linears' bytes, the fast forward's decode step
(`FastLlama.forward` of `--rows` decode rows, median of `--steps` steps after a prompt chunk each) and a prompt chunk
of `--prompt` tokens (median of 5), and whether the greedy tokens and the logits of the kept weights are those of the
de-quantized weights (the same weights: only the sums' order differs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from act_order_cpu import (  # noqa: E402 - benchmarks/: the script's folder is on sys.path
    BLOCK,
    agreement,
    finish,
    shape_arguments,
    shape_setup,
    timed,
)

from lmiserve.engine.attention.paged import paged_cache  # noqa: E402
from lmiserve.engine.model import cpu_codes  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402
from lmiserve.models.quant_pack import write_quantized  # noqa: E402
from tests.helpers.tiny_model import build_tiny_tokenizer  # noqa: E402

FORMATS = ("fp8-channel", "fp8-tensor", "fp8-block")
NOW, BEFORE = "kept fp8 (now)", "de-quantized fp32 (before)"


def prompt_chunk(model: torch.nn.Module, tokens: int, runs: int = 5) -> float:
    """Median seconds of one prompt chunk of `tokens` tokens (each run a sequence of its own)."""
    per_seq = -(-tokens // BLOCK)
    fast = FastLlama(model, paged_cache(model, runs * per_seq, BLOCK), tokens)
    generator = torch.Generator().manual_seed(2)
    times = []
    with torch.inference_mode():
        for run in range(runs):
            ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=generator).tolist()
            table = list(range(run * per_seq, (run + 1) * per_seq))
            start = time.perf_counter()
            fast.forward(StepInputs(chunks=[(table, 0, ids)], keep=[tokens - 1]))
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def served(folder: Path, before: bool) -> tuple[torch.nn.Module, dict[str, int]]:
    original = cpu_codes.fp8_layer
    if before:  # as before 2026-12-07: no CPU layer of fp8 weights, every one de-quantized to fp32 at load
        cpu_codes.fp8_layer = lambda weight, scale, bias: None  # type: ignore[assignment]
    try:
        model = load_causal_lm(folder, device="cpu").model
    finally:
        cpu_codes.fp8_layer = original
    kinds: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2].endswith("_proj"):
            weight = getattr(module, "weight", None)
            kind = f"{type(module).__name__} ({str(getattr(weight, 'dtype', '?')).removeprefix('torch.')})"
            kinds[kind] = kinds.get(kind, 0) + 1
    return model, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=FORMATS, default="fp8-channel")
    parser.add_argument("--prompt", type=int, default=128)
    shape_arguments(parser)
    args = parser.parse_args()
    began = time.time()
    rows, source, results = shape_setup(args, format=args.format)
    logits: dict[str, dict[int, list[torch.Tensor]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.format
        write_quantized(source, folder, args.format, group=128)
        build_tiny_tokenizer().save_pretrained(folder)
        for label, before in ((NOW, False), (BEFORE, True)):
            model, kinds = served(folder, before)
            entry, logits[label] = timed(model, kinds, rows, args.steps)
            entry[f"prompt_chunk_ms_{args.prompt}_tokens"] = round(prompt_chunk(model, args.prompt) * 1000, 2)
            results["served"][label] = entry
            print(label, json.dumps(entry), flush=True)
            del model
    results["kept_vs_dequantized"] = agreement(logits[NOW], logits[BEFORE])
    finish(results, "kept_vs_dequantized", began, args.json)


if __name__ == "__main__":
    main()
