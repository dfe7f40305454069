"""Image requests to a vision-language model: lmiserve's forward of its decoder (runner/vision_fast.py) against
transformers' forward of the VLM (runner/vision.py, what every VLM step ran before 2026-12-02), in one run.

    .venv/bin/python benchmarks/vlm_paths.py [--shape smolvlm-256m|llava-1b|qwen2-vl-2b|qwen3-vl-2b] [--streams 1,4]
        [--tokens 32] [--order fast,vlm] [--device cpu|cuda] [--dtype fp32|bf16] [--json FILE]

The model: random weights (seeded) in the shape of a published VLM's decoder, with the tests' tiny vision tower
and processor (tests/helpers/tiny_vlm.py; the encoder runs once an image, at admission, outside the decode):
- ``smolvlm-256m``: HuggingFaceTB/SmolVLM-256M-Instruct's decoder (Idefics3; SmolLM2-135M's shape: hidden 576,
  30 layers, 9 heads, 3 KV heads, vocabulary 49,280);
- ``llava-1b``: a LLaVA over Llama 3.2 1B's shape (hidden 2,048, 16 layers, 32 heads, 8 KV heads, vocabulary
  128,256), as the llava-hf conversions of 1B decoders are;
- ``qwen2-vl-2b``: Qwen/Qwen2-VL-2B-Instruct's decoder (Qwen2-1.5B's shape with M-RoPE, ``mrope_section``
  [16, 24, 24]: its text rows rotated at shifted positions);
- ``qwen3-vl-2b``: Qwen/Qwen3-VL-2B-Instruct's decoder (hidden 2,048, 28 layers, 16 heads of 128, 8 KV heads,
  interleaved M-RoPE [24, 20, 20]), with the tests' tower's two DeepStack layers (the 2B's has three).

On CUDA the fast path replays its decode graphs (``fast``) where transformers' forward runs every step eagerly
(``vlm``); the GPU check runs this on SmolVLM-256M's shape (its ``vlm-paths`` step).

For each path an engine is built over the same loaded model, alone on the machine; `streams` image requests
(each its own image, 32 greedy tokens, EOS ignored) run at once after a warm-up request. Reported: the tokens
a second of the whole batch (first submission to last token), the median time to first token, and whether
every request's tokens equal the first path's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smolvlm-256m": (
        "idefics3",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49280,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
        },
    ),
    "llava-1b": (
        "llava",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "max_position_embeddings": 8192,
        },
    ),
    "qwen2-vl-2b": (
        "qwen2_vl",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
        },
    ),
    "qwen3-vl-2b": (
        "qwen3_vl",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
}


def build(shape: str, out: Path) -> Path:
    """The tests' tiny `family` VLM with its decoder resized to `shape` (random weights, seeded, fp32)."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from helpers import tiny_vlm

    family, text = SHAPES[shape]
    config, processor = tiny_vlm._spec(family)
    kinds = getattr(config.text_config, "layer_types", None)  # (the tests' layers' kinds, repeated over the shape's)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    if kinds:
        config.text_config.layer_types = [kinds[i % len(kinds)] for i in range(text["num_hidden_layers"])]
    if family == "qwen2_vl":  # the merger's output is the decoder's width; M-RoPE's sections as published
        config.vision_config.hidden_size = text["hidden_size"]
        config.text_config.rope_parameters["mrope_section"] = [16, 24, 24]
    if family == "qwen3_vl":  # the same (the tests' tower's two DeepStack layers, where the 2B has three)
        config.vision_config.out_hidden_size = text["hidden_size"]
        config.text_config.rope_parameters["mrope_section"] = [24, 20, 20]
    tokenizer = processor.tokenizer
    torch.manual_seed(tiny_vlm.TINY_VLM_SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


async def run(
    engine: Any, requests: list[tuple[str, tuple[Any, ...]]], tokens: int
) -> tuple[list[list[int]], float, float]:
    from lmiserve.core.request import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)
    start = time.perf_counter()
    firsts: list[float] = []

    async def one(prompt: str, images: tuple[Any, ...]) -> list[int]:
        out: list[int] = []
        async for event in engine.generate(GenerationRequest(prompt, params, images=images)):
            if event.token is not None:
                if not out:
                    firsts.append(time.perf_counter() - start)
                out.append(event.token.id)
        return out

    results = await asyncio.gather(*(one(p, im) for p, im in requests))
    wall = time.perf_counter() - start
    return list(results), wall, statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smolvlm-256m", choices=sorted(SHAPES))
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--order", default="fast,vlm")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json")
    args = parser.parse_args()

    from helpers.vlm_serving import chat, image_of, prompt_of
    from lmiserve.engine.attention import cuda_graphs
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine
    from lmiserve.models.load import load_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp) / args.shape)
        loaded = load_causal_lm(path, dtype=args.dtype, device=args.device)
    report: dict[str, Any] = {"shape": args.shape, "tokens": args.tokens, "device": args.device, "dtype": args.dtype}
    report.update(levels=[], steps={})
    first_tokens: dict[int, list[list[int]]] = {}

    async def measure(path_name: str) -> None:
        engine = create_engine(loaded, EngineConfig(fast_path=path_name == "fast", kv_cache_memory_bytes=2**30))
        runner = engine.executor.runner
        engine.start()
        try:
            levels = [int(s) for s in args.streams.split(",")]
            for streams in levels:  # (on CUDA: each level's decode graphs captured before it is timed)
                await run(
                    engine, [(prompt_of(loaded, chat("Warm up.")), (image_of(99 - i),)) for i in range(streams)], 4
                )
            for streams in levels:
                requests = [
                    (prompt_of(loaded, chat(f"Picture {i}: what is in it?")), (image_of(10 + i),))
                    for i in range(streams)
                ]
                results, wall, ttft = await run(engine, requests, args.tokens)
                level = {
                    "path": path_name,
                    "runner": type(runner).__name__,
                    "decode_graphs": cuda_graphs.of_runner(runner) is not None,
                    "streams": streams,
                    "tokens_per_s": round(sum(map(len, results)) / wall, 2),
                    "ttft_ms_p50": round(ttft * 1000, 1),
                    "same_tokens_as_first_path": first_tokens.setdefault(streams, results) == results,
                }
                report["levels"].append(level)
                print(json.dumps(level), flush=True)
        finally:
            await engine.stop()
        report["steps"][path_name] = dict(getattr(runner, "steps", {}))

    for path_name in args.order.split(","):
        asyncio.run(measure(path_name))
    print(json.dumps(report["steps"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
