"""A gpt-oss checkpoint as OpenAI publishes gpt-oss: its experts' weights in MXFP4 (``*_blocks``: two 4-bit floats a
byte, the low nibble first, 32 values a block; ``*_scales``: a block's power of two, ``2 ** (s - 127)``), everything
else as saved; ``quantization_config: mxfp4``. The experts' weights are drawn as MXFP4 values, so the tiny model
whose state `write_mxfp4_gpt_oss` returns holds them exactly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def write_mxfp4_gpt_oss(out: Path, intermediate: int = 64) -> dict[str, torch.Tensor]:
    """Write the tests' tiny gpt-oss (tests/helpers/llama_variants.py, its MLP `intermediate` wide: blocks of 32) with
    its tokenizer to `out` as an MXFP4 checkpoint; the float state dict it holds."""
    from safetensors.torch import load_file, save_file

    from helpers.llama_variants import MOE_ARCHS, build
    from helpers.tiny_model import build_tiny_tokenizer

    config_cls, model_cls, extra = MOE_ARCHS["gpt_oss"]
    model = build(config_cls, model_cls, {**extra, "intermediate_size": intermediate})
    generator = torch.Generator().manual_seed(5)
    packed = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(layer.mlp.experts, name)  # [experts, in, out]
            experts, inputs, outputs = weight.shape
            codes = torch.randint(0, 16, (experts, outputs, inputs // 32, 32), generator=generator)
            exponents = torch.randint(122, 127, (experts, outputs, inputs // 32), generator=generator)
            values = FP4[codes] * torch.pow(2.0, (exponents - 127).float())[..., None]
            with torch.no_grad():
                weight.copy_(values.reshape(experts, outputs, inputs).transpose(1, 2))
            at = f"model.layers.{i}.mlp.experts.{name}"
            packed[f"{at}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
            packed[f"{at}_scales"] = exponents.to(torch.uint8)
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    kept = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": kept}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
