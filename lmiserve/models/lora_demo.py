"""Random LoRA adapters of a model, written as PEFT writes them (`adapter_config.json`,
`adapter_model.safetensors`): for trying adapters out (docs/lora.md) and for `lmiserve bench --lora`.

The adapters are random (B not zero, so every product counts and the output changes), of one rank, on
the chosen linears of every layer of a Llama-family model: what a fine-tune of that rank costs to serve,
whatever it learned.

    python -m lmiserve.models.lora_demo /tmp/adapters --names sql,chat --rank 8
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LORA_TARGETS", "make_adapters"]

LORA_TARGETS = {
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qv": ("q_proj", "v_proj"),
}


def make_adapters(
    model_path: Path,
    out_dir: Path,
    count: int,
    rank: int,
    targets: Sequence[str],
    names: Sequence[str] = (),
    scale: float = 0.01,
) -> dict[str, Path]:
    """`count` adapters (named `names`, else ``lora-0`` ...) of the model in `model_path` (its config.json),
    in `out_dir`; B's entries have standard deviation `scale`, each adapter its own seed (from its name)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    shapes = {  # (in, out)
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, config.intermediate_size),
        "up_proj": (hidden, config.intermediate_size),
        "down_proj": (config.intermediate_size, hidden),
    }
    owner = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    out: dict[str, Path] = {}
    for index in range(count):
        name = names[index] if index < len(names) else f"lora-{index}"
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode("utf-8")))
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module in targets:
                fan_in, fan_out = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.{owner.get(module, 'mlp')}.{module}"
                a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(fan_out, rank, generator=generator) * scale
                ).contiguous()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(targets),
            "bias": "none",
            "base_model_name_or_path": str(model_path),
        }
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2), encoding="utf-8")
        out[name] = folder
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lmiserve.models.lora_demo OUT_DIR``: random demo adapters of a model (default the bundled one)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lmiserve.models.lora_demo",
        description="Write random LoRA adapters of a model (PEFT's files) for trying adapters out or benchmarking.",
    )
    parser.add_argument("out_dir", type=Path, help="folder the adapters go into (lora-0, lora-1, ...)")
    parser.add_argument("--model-id", help="the model's directory (default: the bundled model)")
    parser.add_argument("--count", type=int, default=2, help="adapters to write (default 2, or as many as --names)")
    parser.add_argument("--names", default="", help="their names, comma-separated (default lora-0, lora-1, ...)")
    parser.add_argument("--scale", type=float, default=0.01, help="standard deviation of B's entries (default 0.01)")
    parser.add_argument("--rank", type=int, default=8, help="their rank (default 8)")
    parser.add_argument("--targets", choices=sorted(LORA_TARGETS), default="all", help="linears they adapt")
    args = parser.parse_args(argv)
    if args.model_id:
        model_path = Path(args.model_id)
    else:
        from lmiserve.models.bundled import bundled_model_path

        model_path = bundled_model_path()
    names = [n for n in args.names.split(",") if n]
    count = len(names) or args.count
    made = make_adapters(model_path, args.out_dir, count, args.rank, LORA_TARGETS[args.targets], names, args.scale)
    for name, folder in made.items():
        print(f"{name}: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
