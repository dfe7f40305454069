"""What a tensor-parallel rank keeps of a quantized row-parallel linear whose part starts inside a group.

    python benchmarks/tp_split_groups.py [--formats awq,gptq-int8,fp8-block] [--degrees 2,4,8]
                                         [--hidden 8192] [--intermediate 29568] [--json FILE]

A one-layer Llama of a Qwen2-72B's MLP shape (hidden 8192, intermediate 29568: 231 groups of 128, so a rank's part
of `down_proj`'s inputs starts inside a group over 2, 4 and 8 ranks) is written in each format with random weights,
and each rank's shard is loaded on the CPU as a worker loads it (`shard_checkpoint.load_shard_weights`, the kernels'
keep decision forced on). For every rank it reports `down_proj`'s layer, the groups its inputs are read by, the
bytes it holds against its part in bf16, and whether its weight is exactly its cut of the whole checkpoint's: once as
served (`shard_quantized.whole_groups`) and once as before 2026-12-06 18:25 (`stored_groups_only`: a rank's part
read by the stored groups, de-quantized where it starts or, for codes, ends inside one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmiserve.engine.model import shard_checkpoint, shard_quantized  # noqa: E402
from lmiserve.engine.model.sharding import column_run, shard_model, shard_of  # noqa: E402
from lmiserve.models.load import load_model_shell  # noqa: E402
from lmiserve.models.quant_pack import write_quantized  # noqa: E402
from lmiserve.models.quantized_load import checkpoint_quantization  # noqa: E402
from tests.helpers.tiny_model import build_tiny_tokenizer  # noqa: E402

GROUPS = {"awq": 128, "gptq": 128, "gptq-int8": 128, "fp8-block": 128}


def random_llama(
    hidden: int, intermediate: int, layers: int = 1, head_dim: int = 128, std: float = 0.02
) -> torch.nn.Module:
    """A Llama of random weights (`std`) with the tiny tokenizer's vocabulary: `layers` of `hidden` and `intermediate`,
    heads of `head_dim`, as many KV heads up to 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // head_dim
    config = LlamaConfig(
        vocab_size=len(build_tiny_tokenizer()),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=min(8, heads),
        tie_word_embeddings=True,
        initializer_range=std,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def held_bytes(module: torch.nn.Module) -> int:
    """The bytes of the tensors a layer holds (its parameters, buffers and plain tensor attributes)."""
    seen = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    for value in vars(module).values():
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t
            elif t is not None and hasattr(t, "__dict__"):  # (scales kept in a small object: Int4Scales)
                seen.update({id(x): x for x in vars(t).values() if isinstance(x, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in seen.values())


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    return module.dequantized().float() if hasattr(module, "dequantized") else module.weight.detach().float()


def rank_down(folder: Path, rank: int, world: int) -> tuple[torch.nn.Module, slice]:
    loaded = load_model_shell(folder, dtype="fp32", device="cpu")
    shard_model(loaded.model, rank, world, None)
    shard_checkpoint.load_shard_weights(
        loaded.model, folder, checkpoint_quantization(folder, None), torch.device("cpu")
    )
    down = loaded.model.model.layers[0].mlp.down_proj
    return down, column_run(shard_of(loaded.model).plan, "down_proj", down.in_features * world)


def stored_groups_only(size: int, *edges: int, least: int = 0) -> int:
    """`whole_groups` as it was before the finer groups: the stored groups where the rank's part is whole ones."""
    return size if all(edge % size == 0 for edge in edges) else 0


def measure(folder: Path, whole: torch.Tensor, degrees: list[int], finer: bool) -> list[dict[str, Any]]:
    served = shard_quantized.whole_groups
    shard_quantized.whole_groups = served if finer else stored_groups_only
    rows = []
    try:
        for world in degrees:
            for rank in range(world):
                start = time.perf_counter()
                down, columns = rank_down(folder, rank, world)
                seconds = time.perf_counter() - start
                part = whole[:, columns]
                rows.append(
                    {
                        "degree": world,
                        "rank": rank,
                        "first_input": columns.start,
                        "layer": type(down).__name__,
                        "repr": down.extra_repr(),
                        "bytes": held_bytes(down),
                        "bf16_bytes": part.numel() * 2,
                        "exact_cut": bool(torch.equal(dequantized(down), part)),
                        "load_s": round(seconds, 2),
                    }
                )
    finally:
        shard_quantized.whole_groups = served
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="awq,gptq-int8,fp8-block")
    parser.add_argument("--degrees", default="2,4,8")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--intermediate", type=int, default=29568)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shard_checkpoint.weights_kept_for = lambda *a: True  # (the kernels' keep: where bf16 would not fit the GPU)
    degrees = [int(d) for d in args.degrees.split(",")]
    model = random_llama(args.hidden, args.intermediate)
    report: dict[str, Any] = {"hidden": args.hidden, "intermediate": args.intermediate, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            folder = Path(tmp) / fmt
            write_quantized(model, folder, fmt, GROUPS[fmt])
            build_tiny_tokenizer().save_pretrained(folder)
            whole = dequantized(rank_down(folder, 0, 1)[0])
            served, before = (measure(folder, whole, degrees, finer) for finer in (True, False))
            report["formats"][fmt] = {"served": served, "before": before}
            for now, then in zip(served, before, strict=True):
                print(  # (held bytes: on a CPU; a GPU's kernels hold the same codes in their own layout)
                    f"{fmt:10} degree {now['degree']} rank {now['rank']} (input {now['first_input']:5}): "
                    f"{now['layer']} {now['bytes'] / 2**20:7.1f} MiB, exact {now['exact_cut']} "
                    f"[{now['repr'].split(', ', 2)[-1]}]; before {then['layer']} "
                    f"{then['bytes'] / 2**20:7.1f} MiB; bf16 part {now['bf16_bytes'] / 2**20:7.1f} MiB",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
