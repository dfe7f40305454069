"""Quantized checkpoints of the tiny vision-language models (helpers/tiny_vlm.py), for the quantized VLM tests
(tests/unit/test_vlm_quantized.py, tests/integration/test_tensor_parallel_vlm_engine.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from lmiserve.engine.model.fp8_ops import quantize_fp8


def processor_files(float_dir: Path, out: Path) -> None:
    """The processor's files of `float_dir` (tokenizer, image processor, chat template) copied beside `out`'s weights."""
    for file in float_dir.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(file, out / file.name)


LANGUAGE_LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
FP8_DYNAMIC = {  # what llm-compressor writes for its FP8_DYNAMIC scheme, the vision tower left float
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
        }
    },
    "ignore": ["lm_head", "re:.*visual.*", "re:.*vision_tower.*"],
}


def fp8_channel_copy(float_dir: Path, out: Path, dequantize: bool) -> int:
    """`float_dir`'s checkpoint (its tensors under the family's published names) with its language model's linears
    fp8 per output channel (``weight``, ``weight_scale`` ``[out, 1]``), or (`dequantize`) those values written back
    in fp32 (the float model the checkpoint encodes); how many linears."""
    shutil.copytree(float_dir, out)
    state = load_file(out / "model.safetensors")
    names = [n for n in state if LANGUAGE_LINEAR.search(n) and "vision" not in n and "visual" not in n]
    for name in names:
        q, scale = quantize_fp8(state[name].float())
        scale = scale.float().reshape(-1, 1)  # (a row's scale, as compressed-tensors stores it)
        if dequantize:
            state[name] = q.float() * scale
        else:
            state[name], state[f"{name}_scale"] = q, scale
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if not dequantize:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_DYNAMIC}))
    return len(names)


def quantized_vlm(float_dir: Path, out: Path, fmt: str, group: int = 32) -> Path:
    """`float_dir`'s tiny VLM as a `fmt` checkpoint in `out`, with its processor's files: ``fp8-channel`` as
    `fp8_channel_copy` writes it (the decoder fp8 under the published names, the vision tower float); a format of
    `models.quant_pack` (``fp8-block`` by blocks of 16, ``awq``, ``gptq``: every linear, the vision tower's too) or of
    compressed-tensors (``w4a16``, ``w4a16-asym``, ``w8a8``, ``w8a16``: helpers/compressed_ints.py, every linear but
    the head), by groups of `group` inputs."""
    import torch
    from transformers import AutoModelForImageTextToText

    from helpers.compressed_ints import FORMATS as COMPRESSED_INTS
    from helpers.compressed_ints import write_compressed
    from lmiserve.models.quant_pack import write_quantized

    if fmt == "fp8-channel":
        fp8_channel_copy(float_dir, out, dequantize=False)
        return out
    model = AutoModelForImageTextToText.from_pretrained(float_dir, dtype=torch.float32)
    if fmt in COMPRESSED_INTS:
        write_compressed(model, out, fmt, group)
    else:
        write_quantized(model, out, fmt, group=16 if fmt == "fp8-block" else group)
    processor_files(float_dir, out)
    return out
