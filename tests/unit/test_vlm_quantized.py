"""A vision-language model's block-wise fp8 checkpoint (Qwen3-VL's and Qwen2.5-VL's ``-FP8`` releases: every
projection fp8 with a scale a block of 128, as transformers publishes it): loaded as the VLM it is (its processor,
its vision tower), every fp8 weight its values times their blocks' scales, and its image prompts served with the
greedy tokens transformers' `generate()` gives over the same weights written out in float. Other quantized formats
of a VLM are refused in one line."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.tiny_vlm import build_tiny_vlm_dir
from helpers.vlm_serving import chat, config, image_of, prompt_of, reference, same, serve
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm
from lmiserve.models.quant_pack import write_quantized

BLOCK = 16


def _dequantized_copy(fp8: Path, out: Path) -> Path:
    """`fp8`'s checkpoint with every fp8 weight written as its values times its blocks' scales (fp32), and no
    quantization_config: the float model the checkpoint encodes, read independently of lmiserve and transformers."""
    shutil.copytree(fp8, out)
    state = load_file(out / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight_scale_inv")]:
        scale, base = state.pop(name), name.removesuffix("_scale_inv")
        q = state[base].float()
        state[base] = (q.reshape(q.shape[0] // BLOCK, BLOCK, -1, BLOCK) * scale[:, None, :, None]).reshape(q.shape)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def fp8_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("vlm-fp8")
    float_dir = build_tiny_vlm_dir("qwen3_vl", root / "float")
    model = AutoModelForImageTextToText.from_pretrained(float_dir, dtype=torch.float32)
    written = write_quantized(model, root / "fp8", "fp8-block", group=BLOCK)
    for file in float_dir.iterdir():  # the processor's files (tokenizer, image processor, chat template)
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(file, root / "fp8" / file.name)
    return root / "fp8", _dequantized_copy(root / "fp8", root / "dequantized"), len(written)


def test_a_block_wise_fp8_vlm_loads_as_the_vlm_with_every_weight_dequantized(fp8_vlm):
    fp8, dequantized, written = fp8_vlm
    assert written > 0
    loaded = load_causal_lm(fp8, dtype="fp32", device="cpu")
    assert loaded.processor is not None
    expected = load_causal_lm(dequantized, dtype="fp32", device="cpu").model.state_dict()
    got = loaded.model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_a_block_wise_fp8_vlms_image_prompts_get_generates_tokens(fp8_vlm):
    fp8, dequantized, _ = fp8_vlm
    loaded = load_causal_lm(fp8, dtype="fp32", device="cpu")
    first = (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),))
    other = (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),))
    results, _ = asyncio.run(serve(loaded, config(), [first, other]))
    assert same(results, [reference(dequantized, *r) for r in (first, other)])


def test_a_vlm_in_another_quantized_format_is_refused_in_one_line(fp8_vlm, tmp_path):
    fp8, _, _ = fp8_vlm
    shutil.copytree(fp8, tmp_path / "vlm")
    cfg = json.loads((tmp_path / "vlm" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (tmp_path / "vlm" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantize awq is not supported for vision-language models yet"):
        load_causal_lm(tmp_path / "vlm", device="cpu")
