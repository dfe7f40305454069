"""The quality of a KV cache narrower than the model (`kv_cache_dtype`): perplexity on a fixed text and greedy
agreement, for `auto` (the model's dtype) against `fp8_e4m3` and `fp8_e5m2` (or `--kv-dtypes`, e.g. `bfloat16` under
an fp32 model), through the engine (issue 39, item 3).

    .venv/bin/python benchmarks/kv_fp8_quality.py [--dtype fp32|bf16] [--prompts 32] [--tokens 32]
        [--kv-dtypes auto,fp8_e4m3,fp8_e5m2] [--out benchmarks/results/issue39-fp8kv-2026-11-29]

The bundled SmolLM2-135M (or --model-id DIR) in-process on this machine's device, once per KV dtype:

- perplexity of benchmarks/texts/pride_and_prejudice_ch1.txt (Austen, 1813, public domain; ~1,100 tokens)
  from the engine's prompt logprobs, the text prefilled in chunks of `--chunk` tokens so that each chunk
  attends over the earlier chunks' keys and values as the pool stores them; and the share of the text's
  positions where the most likely next token equals `auto`'s (teacher-forced top-1 agreement);
- greedy agreement over `--prompts` prompts of `--tokens` new tokens against `auto`: the share of sequences
  equal token for token, the share of tokens before each sequence's first difference, the mean first
  differing position;
- the blocks the same memory bound (`--pool-mib`) holds.

Writes `kv_fp8_quality.json` and `kv_fp8_quality.md` under `--out` (with the CPU's `lscpu` model name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import torch
from machine import cpu_model  # benchmarks/machine.py: the script's folder is on sys.path

from lmiserve.core import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.models import load_causal_lm
from lmiserve.models.bundled import bundled_model_path

HERE = Path(__file__).resolve().parent
TEXT = HERE / "texts" / "pride_and_prejudice_ch1.txt"
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
TOPICS = ["the sea", "gravity", "a city at night", "machine learning", "the moon", "coffee", "trains", "music"]
TEMPLATES = [
    "Write a short poem about {}.",
    "Explain {} in simple words.",
    "What is interesting about {}?",
    "Tell me a story about {}.",
]


def prompts(count: int, tokenizer) -> list[str]:
    texts = [
        TEMPLATES[i % len(TEMPLATES)].format(TOPICS[(i // len(TEMPLATES) + i) % len(TOPICS)]) for i in range(count)
    ]
    chat = [[{"role": "user", "content": t}] for t in texts]
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chat]


async def text_scores(engine: AsyncEngine, ids: list[int]) -> tuple[list[float], list[int]]:
    """The logprob of each token of `ids` after the first, and the most likely token at each position."""
    params = SamplingParams(max_new_tokens=1, decoder_input_details=True, prompt_top_n=1)
    events = [e async for e in engine.generate(GenerationRequest("", params, prompt_ids=ids))]
    finish = events[-1].finish
    assert finish is not None and finish.prefill is not None and finish.prefill_top is not None
    logprobs = [t.logprob for t in finish.prefill[1:]]
    assert all(lp is not None for lp in logprobs)
    top = [tops[0].id for tops in finish.prefill_top[1:] if tops]
    return [float(lp) for lp in logprobs if lp is not None], top


async def greedy(engine: AsyncEngine, texts: list[str], tokens: int) -> list[list[int]]:
    async def one(text: str) -> list[int]:
        params = SamplingParams(max_new_tokens=tokens)
        return [e.token.id for e in [e async for e in engine.generate(GenerationRequest(text, params))] if e.token]

    return list(await asyncio.gather(*(one(t) for t in texts)))


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    firsts, before, total = [], 0, 0
    for ref, out in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
        if first is None and len(ref) != len(out):
            first = min(len(ref), len(out))
        firsts.append(len(ref) if first is None else first)
        before += len(ref) if first is None else first
        total += len(ref)
    exact = sum(ref == out for ref, out in zip(reference, other, strict=True))
    return {
        "sequences_equal": exact / len(reference),
        "tokens_before_first_difference": before / total,
        "mean_first_difference": sum(firsts) / len(firsts),
    }


async def run_one(loaded, kv_dtype: str, args, ids: list[int], texts: list[str]) -> dict:
    budget = args.pool_mib * 2**20
    config = EngineConfig(
        kv_cache_dtype=kv_dtype,
        kv_cache_memory_bytes=budget,
        max_prefill_tokens=args.chunk,
        max_running=max(8, args.concurrency),
        enable_prefix_caching=False,
    )
    engine = create_engine(loaded, config)
    engine.start()
    try:
        start = time.perf_counter()
        logprobs, top = await text_scores(engine, ids)
        ppl_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs = []
        for at in range(0, len(texts), args.concurrency):
            outputs.extend(await greedy(engine, texts[at : at + args.concurrency], args.tokens))
        greedy_s = time.perf_counter() - start
        blocks = engine.runner.num_blocks
        pool_dtype = str(engine.runner.kv.kv_dtype)
    finally:
        await engine.stop()
    nll = -sum(logprobs) / len(logprobs)
    return {
        "kv_cache_dtype": kv_dtype,
        "pool_dtype": pool_dtype,
        "pool_blocks": blocks,
        "perplexity": math.exp(nll),
        "nll": nll,
        "text_tokens_scored": len(logprobs),
        "top1": top,
        "outputs": outputs,
        "seconds": {"perplexity": round(ppl_s, 2), "greedy": round(greedy_s, 2)},
    }


async def main_async(args) -> dict:
    model_dir = Path(args.model_id) if args.model_id else bundled_model_path()
    loaded = load_causal_lm(model_dir, dtype=args.dtype, device=args.device)
    ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
    texts = prompts(args.prompts, loaded.tokenizer)
    runs = {name: await run_one(loaded, name, args, ids, texts) for name in args.kv_dtypes.split(",")}
    reference = None
    if args.reference_dtype and args.reference_dtype != args.dtype:  # how far the model's dtype alone moves
        del loaded
        ref_loaded = load_causal_lm(model_dir, dtype=args.reference_dtype, device=args.device)
        reference = await run_one(ref_loaded, "auto", args, ids, texts)
    base = runs["auto"]
    results = []
    for run in runs.values():
        entry = {k: v for k, v in run.items() if k not in ("top1", "outputs")}
        entry["top1_agreement_with_auto"] = _same(base["top1"], run["top1"])
        entry["greedy_vs_auto"] = agreement(base["outputs"], run["outputs"])
        if reference is not None:
            entry[f"top1_agreement_with_{args.reference_dtype}_auto"] = _same(reference["top1"], run["top1"])
            entry[f"greedy_vs_{args.reference_dtype}_auto"] = agreement(reference["outputs"], run["outputs"])
        entry["greedy_outputs"] = run["outputs"]
        results.append(entry)
    return {
        "benchmark": "kv_fp8_quality",
        "model": str(model_dir),
        "dtype": args.dtype,
        "device": args.device,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "text": str(TEXT.relative_to(HERE.parent)),
        "text_tokens": len(ids),
        "prefill_chunk": args.chunk,
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "pool_mib": args.pool_mib,
        "reference_dtype": args.reference_dtype if reference is not None else None,
        "reference_perplexity": reference["perplexity"] if reference is not None else None,
        "results": results,
    }


def _same(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def markdown(report: dict) -> str:
    lines = [
        f"# KV cache quality: {Path(report['model']).name}, {report['dtype']} on {report['device']}",
        "",
        f"CPU: {report['cpu']}; torch {report['torch']}. Text: `{report['text']}` ({report['text_tokens']} tokens,"
        f" prefilled in chunks of {report['prefill_chunk']}). Greedy: {report['prompts']} chat prompts x"
        f" {report['new_tokens']} tokens. Pool: {report['pool_mib']} MiB.",
        "",
        "| kv_cache_dtype | pool blocks | perplexity | top-1 = auto | sequences = auto | tokens before 1st diff |"
        " mean 1st diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        g = r["greedy_vs_auto"]
        lines.append(
            f"| {r['kv_cache_dtype']} ({r['pool_dtype'].replace('torch.', '')}) | {r['pool_blocks']} |"
            f" {r['perplexity']:.3f} | {100 * r['top1_agreement_with_auto']:.1f} % |"
            f" {100 * g['sequences_equal']:.0f} % | {100 * g['tokens_before_first_difference']:.1f} % |"
            f" {g['mean_first_difference']:.1f} |"
        )
    ref = report.get("reference_dtype")
    if ref:
        lines += [
            "",
            f"Against the model in {ref} (`auto` KV; its perplexity {report['reference_perplexity']:.3f}): how far"
            f" {report['dtype']} weights and compute alone move the output, beside the KV cache's loss.",
            "",
            f"| kv_cache_dtype | top-1 = {ref} | sequences = {ref} | tokens before 1st diff | mean 1st diff |",
            "|---|---|---|---|---|",
        ]
        for r in report["results"]:
            g = r[f"greedy_vs_{ref}_auto"]
            lines.append(
                f"| {r['kv_cache_dtype']} | {100 * r[f'top1_agreement_with_{ref}_auto']:.1f} % |"
                f" {100 * g['sequences_equal']:.0f} % | {100 * g['tokens_before_first_difference']:.1f} % |"
                f" {g['mean_first_difference']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="prefill tokens a step (the text's chunks)")
    parser.add_argument("--pool-mib", type=int, default=64)
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="kv_cache_dtype values, `auto` first")
    parser.add_argument(
        "--reference-dtype", default=None, help="also run `auto` in this dtype (e.g. fp32) and compare against it"
    )
    parser.add_argument("--out", default=None, help="directory for kv_fp8_quality[-<dtype>].json and .md")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"kv_fp8_quality-{args.dtype}-{args.device}"
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
