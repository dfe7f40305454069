"""PEFT LoRA adapters of the tiny vision-language models (helpers/tiny_vlm.py), made in tests as a fine-tune of a VLM's
language model makes them (random, B non-zero: helpers/lora_adapters.py), and their reference: transformers'
greedy `generate()` of the VLM with the adapter merged by PEFT, on the processor's output of a prompt and its
images."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from helpers.tiny_vlm import load_tiny_vlm, reference_inputs

DECODER_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def make_vlm_adapter(
    base_dir: Path, out_dir: Path, targets: str | Sequence[str] = DECODER_TARGETS, seed: int = 1, rank: int = 8
) -> Path:
    """A PEFT adapter of the VLM in `base_dir` on `targets` (a regular expression of module paths, or short names),
    saved into `out_dir` as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=16.0,
        target_modules=targets if isinstance(targets, str) else list(targets),
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (1.0 / param.shape[1] ** 0.5))
    peft_model.save_pretrained(out_dir)
    return out_dir


def renamed_adapter(adapter_dir: Path, out_dir: Path, old: str, new: str) -> Path:
    """A copy of `adapter_dir` whose tensors' names have `old` in place of `new` (an adapter saved under an older
    transformers' module names: LLaVA's ``language_model.model.layers``)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    save_file({k.replace(new, old, 1): v for k, v in tensors.items()}, out_dir / "adapter_model.safetensors")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def merged_vlm_generate(
    base_dir: Path, adapter_dir: Path, messages: str | list[dict[str, Any]], images: Sequence[Any], tokens: int
) -> list[int]:
    """transformers' greedy `generate()` of the VLM in `base_dir` with `adapter_dir` merged by PEFT: the new ids."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    load_tiny_vlm(str(base_dir))  # (the processor, cached)
    inputs = reference_inputs(base_dir, messages, images)
    with torch.inference_mode():
        output = merged.generate(**inputs, max_new_tokens=tokens, do_sample=False, min_new_tokens=0)
    return [int(t) for t in output[0, inputs["input_ids"].shape[1] :]]
