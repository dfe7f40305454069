"""GPTQ act-order (``desc_act``) checkpoints on a CPU: kept as 4-bit codes with their inputs in group order
(`engine/model/input_order.py`) against de-quantized to fp32 as before, and against the same weights in order.
With ``--bits 8``, GPTQ-Int8's symmetric codes, kept on the q8 kernel (`engine/model/cpu_codes.py`; before
2026-12-06 22:30 de-quantized to fp32 with or without act-order).

    python benchmarks/act_order_cpu.py [--bits 4] [--hidden 2048] [--intermediate 8192] [--layers 4] [--steps 32]
                                       [--rows 1,8] [--json FILE]

A Llama of a Llama 3.2 1B's layer shape (hidden 2048, intermediate 8192, 32 heads of 64, 8 KV heads; `--layers` of
them) with random weights is written as GPTQ 4-bit, groups of 128, once with act-order and once without. Each is
loaded as the server loads it (`load_causal_lm`, fp32 on the CPU); the act-order one also as before 2026-12-06 21:30
(`input_order.in_group_order` answering "not served": every layer linear de-quantized to fp32). For each it reports
the layer linears' bytes and the fast forward's decode step (`FastLlama.forward` of `--rows` decode rows, median of
`--steps` steps after a prompt chunk each), and for act-order whether the greedy tokens and the logits of the kept
codes are those of the de-quantized weights (the same weights: only the sums' order differs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402 - benchmarks/machine.py: the script's folder is on sys.path
from tp_split_groups import random_llama  # noqa: E402

from lmiserve.engine.attention.paged import paged_cache  # noqa: E402
from lmiserve.engine.model import cpu_codes, input_order  # noqa: E402
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402
from lmiserve.models.quant_pack import write_quantized  # noqa: E402
from tests.helpers.tiny_model import build_tiny_tokenizer  # noqa: E402

BLOCK = 16
PROMPT = 12


def linear_bytes(model: torch.nn.Module) -> int:
    """The bytes of the layer linears' weights and scales (what a decode step reads)."""
    total = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2].endswith("_proj"):
            tensors = [getattr(module, "weight", None), getattr(module, "scales", None)]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def decode(model: torch.nn.Module, rows: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of a decode step of `rows` rows (each after its own prompt chunk), and each step's logits."""
    per_seq = -(-(PROMPT + steps + 1) // BLOCK)
    fast = FastLlama(model, paged_cache(model, rows * per_seq, BLOCK), PROMPT + steps + 1)
    tables = [list(range(r * per_seq, (r + 1) * per_seq)) for r in range(rows)]
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    last = []
    with torch.inference_mode():
        for table in tables:
            prompt = torch.randint(0, vocab, (PROMPT,), generator=generator).tolist()
            out = fast.forward(StepInputs(chunks=[(table, 0, prompt)], keep=[PROMPT - 1]))
            last.append(int(out[-1].argmax()))
        times, logits = [], []
        for step in range(steps):
            position = PROMPT + step
            start = time.perf_counter()
            out = fast.forward(StepInputs(last, [position] * rows, tables, keep=list(range(rows))))
            times.append(time.perf_counter() - start)
            logits.append(out.float().clone())
            last = out.argmax(-1).tolist()
    return statistics.median(times), logits


def served(folder: Path, before: bool) -> tuple[torch.nn.Module, dict[str, int]]:
    original, q8 = input_order.in_group_order, cpu_codes.q8_layer
    if before:  # as before: act-ordered groups not served, nor 8-bit codes: every such linear de-quantized at load
        input_order.in_group_order = lambda parts: (parts, None, None)  # type: ignore[assignment]
        cpu_codes.q8_layer = lambda parts, bias: None  # type: ignore[assignment]
    try:
        model = load_causal_lm(folder, device="cpu").model
    finally:
        input_order.in_group_order, cpu_codes.q8_layer = original, q8
    kinds: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2].endswith("_proj"):
            kind = type(module).__name__ + (
                " (inputs in group order)" if getattr(module, "order", None) is not None else ""
            )
            kinds[kind] = kinds.get(kind, 0) + 1
    return model, kinds


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the layer-shape benchmarks (this one, fp8_cpu.py): the shape, the steps and rows, the output."""
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--json", type=Path)


def shape_setup(args: argparse.Namespace, **about: Any) -> tuple[list[int], torch.nn.Module, dict[str, Any]]:
    """The rows to time, the random source model of the shape, and the results' head (`about` first)."""
    rows = [int(r) for r in args.rows.split(",")]
    source = random_llama(args.hidden, args.intermediate, args.layers, head_dim=64, std=0.05)
    results: dict[str, Any] = {
        **about,
        "shape": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers},
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "served": {},
    }
    return rows, source, results


def timed(model: torch.nn.Module, kinds: dict[str, int], rows: list[int], steps: int) -> tuple[dict[str, Any], Any]:
    """A served model's entry (its linears, their bytes, a decode step's median at each row count) and each row
    count's step logits."""
    entry: dict[str, Any] = {"linears": kinds, "linear_mib": round(linear_bytes(model) / 2**20, 1)}
    logits = {}
    for n in rows:
        seconds, logits[n] = decode(model, n, steps)
        entry[f"step_ms_{n}_rows"] = round(seconds * 1000, 2)
    return entry, logits


def finish(results: dict[str, Any], key: str, began: float, path: Path | None) -> None:
    """The run's seconds, `key`'s agreement printed, the results written to `path`."""
    results["seconds"] = round(time.time() - began, 1)
    print(json.dumps(results[key]), f"{results['seconds']} s")
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


def agreement(now: dict[int, list[torch.Tensor]], before: dict[int, list[torch.Tensor]]) -> dict[int, dict[str, Any]]:
    """For each row count: whether every step's greedy tokens agree, and the largest logit difference."""
    return {
        n: {
            "same_greedy_tokens": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(now[n], before[n])),
            "max_logit_difference": max(float((a - b).abs().max()) for a, b in zip(now[n], before[n])),
        }
        for n in now
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    shape_arguments(parser)
    args = parser.parse_args()
    began = time.time()
    rows, source, results = shape_setup(args, bits=args.bits)
    logits: dict[str, dict[int, list[torch.Tensor]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for act_order in (True, False):
            folders[act_order] = Path(tmp) / ("desc-act" if act_order else "in-order")
            fmt = "gptq" if args.bits == 4 else "gptq-int8"
            write_quantized(source, folders[act_order], fmt, group=128, act_order=act_order)
            build_tiny_tokenizer().save_pretrained(folders[act_order])
        now_label = f"act-order, kept {args.bits}-bit (now)"
        for label, folder, before in (
            (now_label, folders[True], False),
            ("act-order, de-quantized fp32 (before)", folders[True], True),
            (f"in order, {args.bits}-bit", folders[False], False),
        ):
            model, kinds = served(folder, before)
            entry, logits[label] = timed(model, kinds, rows, args.steps)
            results["served"][label] = entry
            print(label, json.dumps(entry), flush=True)
            del model
    results["act_order_vs_dequantized"] = agreement(logits[now_label], logits["act-order, de-quantized fp32 (before)"])
    finish(results, "act_order_vs_dequantized", began, args.json)


if __name__ == "__main__":
    main()
