"""The quality of quantized weights (issue 39, item 2): greedy agreement with the unquantized model and
perplexity on a fixed text, per checkpoint format, through lmiserve's own loader and engine.

    .venv/bin/python benchmarks/quantized_quality.py [--prompts 32] [--tokens 32] [--group 64]
        [--out benchmarks/results/issue39-quantized-2026-11-29]

The bundled SmolLM2-135M (or --model-id DIR; the bundled one is itself converted from a Q4_1 GGUF, so
its fp32 weights are Q4_1's values), loaded in fp32 on this machine's device, is written as
each format by `lmiserve.models.quant_pack` and loaded back by `load_causal_lm` as a user's checkpoint:

- ``fp8-channel`` / ``fp8-tensor``: compressed-tensors fp8, per output channel / per tensor;
- ``bf16``: the float checkpoint in bf16, for scale (what bf16 alone changes);
- ``fp8-dynamic``: the float checkpoint with ``quantize=fp8`` (per channel at load; vLLM's dynamic fp8);
- ``fp8-block``: block-wise fp8 (Qwen3's and DeepSeek's FP8 releases' format), blocks of `--group` x `--group`
  (128 in those releases; SmolLM2-135M's widths take 64), dequantized at load;
- ``awq``, ``gptq``: 4-bit, asymmetric, groups of `--group` inputs (SmolLM2-135M's hidden size, 576, is
  not a multiple of 128: 64 is the largest published group size that divides it), in AWQ's GEMM packing
  and GPTQ's v1 packing. The 4-bit codes are plain round-to-nearest (RTN): NO calibration, no AWQ
  activation-aware scaling, no GPTQ error feedback; published AWQ/GPTQ checkpoints quantized with
  calibration should do at least as well.
- ``gptq-int8``: GPTQ's 8-bit codes, symmetric (as Qwen's GPTQ-Int8 releases), groups of `--group`, RTN too.
- ``w4a16``, ``w4a16-asym``: compressed-tensors' 4-bit ``pack-quantized`` (llm-compressor's W4A16, symmetric,
  and W4A16_ASYM, with zero points), groups of `--group`; ``w8a8`` (int8 by channel, ``int-quantized``; the
  activations left float) and ``w8a16`` (8-bit codes, groups of `--group`); written by the compressed-tensors
  package itself (`tests/helpers/compressed_ints.py`: min-max scales, also no calibration; a test dependency).
- ``modelopt-fp8``, ``modelopt-fp8-channel``: NVIDIA Model Optimizer's FP8 (a scale a tensor, a static
  ``input_scale`` lmiserve does not use) and FP8_PER_CHANNEL_PER_TOKEN, written by ModelOpt's own export
  (`tests/helpers/modelopt_checkpoints.py`, a test dependency) after calibrating on the `--prompts` prompts.

On a CPU, fp8 weights are de-quantized once at load (fp32 products): the figures are fp8's weights'
accuracy, not its speed; AWQ/GPTQ run on lmiserve's int4 kernel. ``--fp8-products`` (with ``--dtype
bf16``) computes the fp8 formats as a GPU of compute capability 8.9+ does, on the CPU: `Fp8Linear`, the
activations quantized to fp8 per row and one ``torch._scaled_mm`` (torch's CPU kernel), against the model
in bf16: the quality a Hopper GPU serves, which the GPU check cannot measure there (the model does not
travel to the device machine). The tokens/s are one short run each on a shared
machine: a rough figure, not a measurement of the formats' speed. Reported per format:
- perplexity of benchmarks/texts/pride_and_prejudice_ch1.txt (Austen, 1813, public domain), one forward
  of the whole text (transformers' forward over the loaded layers);
- greedy agreement over `--prompts` chat prompts of `--tokens` new tokens, through the engine, against
  the unquantized model through the engine: the share of sequences equal token for token, the share of
  tokens before each sequence's first difference;
- single-stream decode tokens/s through the engine (one prompt, `--tokens` tokens; this CPU, one run).

Writes ``quantized_quality.json`` and ``quantized_quality.md`` under `--out` with `lscpu`'s model name.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmiserve.config import Settings
from lmiserve.core import GenerationRequest, SamplingParams
from lmiserve.models import load_causal_lm, resolve_model_path
from lmiserve.models.compose import build_engine
from lmiserve.models.quant_pack import write_quantized

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests/helpers
from tests.helpers.compressed_ints import write_compressed  # noqa: E402
from tests.helpers.modelopt_checkpoints import installed as modelopt_installed  # noqa: E402
from tests.helpers.modelopt_checkpoints import write_modelopt  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXT = HERE / "texts" / "pride_and_prejudice_ch1.txt"
TOPICS = ["the sea", "gravity", "a city at night", "machine learning", "the moon", "coffee", "trains", "music"]
TEMPLATES = ["Write a short poem about {}.", "Explain {} in simple words.", "What is interesting about {}?"]
# the formats lmiserve makes itself (`--formats own`: what the GPU check runs, on the device and in its rehearsal)
OWN = ("bf16", "fp8-channel", "fp8-tensor", "fp8-dynamic", "fp8-block", "awq", "gptq", "gptq-int8")
FORMATS = OWN
if importlib.util.find_spec("compressed_tensors") is not None:  # (a test dependency: not on the GPU check's device)
    FORMATS += ("w4a16", "w4a16-asym", "w8a8", "w8a16")
if modelopt_installed():  # (a test dependency too)
    FORMATS += ("modelopt-fp8", "modelopt-fp8-channel")


def prompts(count: int, tokenizer) -> list[str]:
    texts = [
        TEMPLATES[i % len(TEMPLATES)].format(TOPICS[(i // len(TEMPLATES) + i) % len(TOPICS)]) for i in range(count)
    ]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")), "unknown"
    )


def perplexity(loaded, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = loaded.model(ids[None]).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="mean")
    return math.exp(nll.item())


async def served(loaded, texts: list[str], tokens: int, concurrency: int) -> tuple[list[list[int]], float]:
    engine = build_engine(loaded, Settings(max_rolling_batch_size=concurrency))
    engine.start()
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str) -> list[int]:
        async with gate:
            req = GenerationRequest(text, SamplingParams(max_new_tokens=tokens, ignore_eos_token=True))
            return [e.token.id async for e in engine.generate(req) if e.token is not None]

    try:
        outputs = list(await asyncio.gather(*(one(t) for t in texts)))
        await one(texts[0])  # warm
        start = time.perf_counter()
        single = await one(texts[0])
        rate = len(single) / (time.perf_counter() - start)
        return outputs, rate
    finally:
        await engine.stop()


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    before = total = 0
    for ref, out in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
        before, total = before + first, total + len(ref)
    exact = sum(ref == out for ref, out in zip(reference, other, strict=True))
    return {
        "sequences_equal": round(exact / len(reference), 4),
        "tokens_before_first_difference": round(before / total, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument(
        "--formats", default=",".join(FORMATS),
        help="comma-separated; 'own': those lmiserve writes itself (no compressed-tensors or ModelOpt writer)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (fp8 then runs Fp8Linear's _scaled_mm)")
    parser.add_argument("--dtype", default=None, help="the reference model's dtype (default fp32 on CPU, bf16 on CUDA)")
    parser.add_argument(
        "--fp8-products", action="store_true",
        help="on a CPU: fp8 formats through Fp8Linear (activations to fp8, torch._scaled_mm), as on Hopper",
    )  # fmt: skip
    parser.add_argument(
        "--int4-kernel", choices=("dequantized", "triton"), default="dequantized",
        help="on CUDA: AWQ/GPTQ de-quantized to bf16 at load (the default) or int4_triton's kernel",
    )  # fmt: skip
    parser.add_argument("--out", default=str(HERE / "results" / "issue39-quantized-2026-11-29"))
    args = parser.parse_args()
    if args.int4_kernel == "triton":
        if not args.device.startswith("cuda"):  # on a CPU AWQ/GPTQ run lmiserve's int4 kernel whatever it says
            raise SystemExit("--int4-kernel triton chooses CUDA's 4-bit product: add --device cuda")
        from lmiserve.engine.model import int4_triton

        int4_triton.USE_ON_CUDA = True
    device = args.device
    dtype = args.dtype or ("fp32" if device == "cpu" else "bf16")
    if args.fp8_products:
        if dtype != "bf16":
            raise SystemExit("--fp8-products computes in bf16, as Fp8Linear on a GPU does: add --dtype bf16")
        from lmiserve.engine.model import quant_formats

        quant_formats.fp8_scaled_mm_supported = lambda device: True  # type: ignore[assignment]

    path = resolve_model_path(args.model_id, None, None)
    base = load_causal_lm(path, dtype=dtype, device=device)
    texts = prompts(args.prompts, base.tokenizer)
    ids = torch.tensor(base.tokenizer(TEXT.read_text(encoding="utf-8")).input_ids, device=base.device)
    t0 = time.time()
    ref_out, ref_rate = asyncio.run(served(base, texts, args.tokens, args.concurrency))
    rows = {
        str(base.dtype).removeprefix("torch."): {
            "perplexity": round(perplexity(base, ids), 4),
            "decode_tokens_per_s": round(ref_rate, 1),
        }
    }
    first = next(iter(rows))
    rows[first].update(agreement(ref_out, ref_out))
    print(first, rows[first], f"{time.time() - t0:.0f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in OWN if args.formats == "own" else args.formats.split(","):
            t0 = time.time()
            if fmt == "bf16":  # for scale: what bf16 alone changes against fp32
                if first == "bfloat16":
                    continue
                loaded = load_causal_lm(path, dtype="bf16", device=device)
            elif fmt == "fp8-dynamic":
                loaded = load_causal_lm(path, dtype=dtype, device=device, quantize="fp8")
            else:
                out = Path(tmp) / fmt
                if fmt in ("w4a16", "w4a16-asym", "w8a8", "w8a16"):  # compressed-tensors' own writer
                    write_compressed(base.model, out, fmt, args.group)
                elif fmt.startswith("modelopt"):  # ModelOpt's own export, calibrated on the prompts
                    calibration = [base.tokenizer(t, return_tensors="pt").input_ids for t in texts]
                    write_modelopt(base.model, out, fmt, calibration=calibration)
                else:
                    write_quantized(base.model, out, fmt, group=args.group)
                base.tokenizer.save_pretrained(out)
                loaded = load_causal_lm(out, dtype=dtype, device=device)
            kinds = sorted({type(m).__name__ for n, m in loaded.model.named_modules() if n.endswith("proj")})
            got, rate = asyncio.run(served(loaded, texts, args.tokens, args.concurrency))
            rows[fmt] = {
                "perplexity": round(perplexity(loaded, ids), 4),
                "decode_tokens_per_s": round(rate, 1),
                "layer_linears": kinds,
                **agreement(ref_out, got),
            }
            print(fmt, rows[fmt], f"{time.time() - t0:.0f} s", flush=True)
            del loaded
    report = {
        "model": str(path),
        "cpu": cpu_model(),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "int4_kernel_on_cuda": args.int4_kernel,
        "dtype": dtype,
        "fp8_products": "Fp8Linear (fp8 activations, torch._scaled_mm)" if args.fp8_products else "by device",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "text": f"benchmarks/texts/{TEXT.name} ({len(ids)} tokens)",
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "concurrency": args.concurrency,
        "group_size": args.group,
        "int4_quantization": (
            "round-to-nearest, no calibration: awq, gptq and w4a16-asym asymmetric, w4a16 symmetric "
            "(storage formats only)"
        ),
        "formats": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quantized_quality.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        f"# Quantized weights: quality on {Path(str(path)).name} ({report['cpu']}, {report['threads']} threads)",
        "",
        f"Text: {report['text']}; greedy: {args.prompts} prompts x {args.tokens} tokens against the first row "
        "through the "
        f"engine on {report['device']}; 4-bit groups of {args.group}, {report['int4_quantization']}.",
        "",
        "| format | perplexity | sequences equal | tokens before 1st difference | decode tok/s (1 stream) | linears |",
        "|---|---|---|---|---|---|",
    ]
    for fmt, row in rows.items():
        lines.append(
            f"| {fmt} | {row['perplexity']} | {row['sequences_equal']:.0%} "
            f"| {row['tokens_before_first_difference']:.0%} "
            f"| {row['decode_tokens_per_s']} | {', '.join(row.get('layer_linears', ['Linear']))} |"
        )
    (out_dir / "quantized_quality.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
