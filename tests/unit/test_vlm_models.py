"""Tiny vision-language models of every family (tests/helpers/tiny_vlm.py) load through lmiserve's model
loading (`load_causal_lm`): model class, eval mode, the processor on the PIL image backend (no
torchvision), its tokenizer the model's; the processor expands an image into as many image tokens as the
vision tower makes features; transformers' greedy reference is deterministic."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny_vlm import (
    FAMILIES,
    IMAGE_TOKEN_ATTR,
    TinyVlmDirs,
    image_token_id,
    load_tiny_vlm,
    reference_generate,
    reference_inputs,
    tiny_image,
)
from lmiserve.engine.loaded import LoadedModel
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm
from lmiserve.models.vision import is_vision_config

MODEL_CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}
# what the processor returns beside input_ids and attention_mask, per family
PROCESSOR_KEYS = {
    "llava": {"pixel_values"},
    "llava_next": {"pixel_values", "image_sizes"},
    "qwen2_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "qwen2_5_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "qwen3_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
    "idefics3": {"pixel_values", "pixel_attention_mask"},
    "gemma3": {"pixel_values", "token_type_ids"},
}
# the image-encoder arguments (`model.model.get_image_features(pixel_values, **these)`)
FEATURE_ARGS = {
    "llava_next": ("image_sizes",),
    "qwen2_vl": ("image_grid_thw",),
    "qwen2_5_vl": ("image_grid_thw",),
    "qwen3_vl": ("image_grid_thw",),
    "idefics3": ("pixel_attention_mask",),
}


def _messages(text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def loaded_vlms(tiny_vlm_dirs: TinyVlmDirs) -> dict[str, LoadedModel]:
    return {family: load_causal_lm(tiny_vlm_dirs[family], dtype="fp32", device="cpu") for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_through_load_causal_lm(family: str, loaded_vlms: dict[str, LoadedModel]) -> None:
    loaded = loaded_vlms[family]
    assert type(loaded.model).__name__ == MODEL_CLASSES[family]
    assert not loaded.model.training
    assert is_vision_config(loaded.model.config)
    processor = loaded.processor
    assert processor is not None
    assert processor.tokenizer is loaded.tokenizer
    assert type(processor.image_processor).__name__.endswith("Pil")  # the PIL backend, never torchvision's
    assert getattr(processor, "video_processor", None) is None
    assert processor.chat_template  # the family's own
    assert isinstance(getattr(loaded.model.config, IMAGE_TOKEN_ATTR[family]), int)
    # the text config's context and the generation config's end of sequence
    assert loaded.max_context == 1024
    assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids
    assert loaded.model.config.get_text_config().vocab_size == len(loaded.tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_expands_an_image_into_its_feature_count(family: str, tiny_vlm_dirs: TinyVlmDirs) -> None:
    path = tiny_vlm_dirs[family]
    model, _ = load_tiny_vlm(str(path))
    inputs = reference_inputs(path, _messages(), [tiny_image(1)])
    assert set(inputs) == {"input_ids", "attention_mask"} | PROCESSOR_KEYS[family]
    ids = inputs["input_ids"][0]
    image_id = image_token_id(model.config)
    count = int((ids == image_id).sum())
    assert count > 0
    args = {name: inputs[name] for name in FEATURE_ARGS.get(family, ())}
    with torch.inference_mode():
        features = model.model.get_image_features(inputs["pixel_values"], **args).pooler_output
    rows = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features) if isinstance(features, (list, tuple)) else None
    if rows is None:
        rows = features.reshape(-1, features.shape[-1]).shape[0]
    assert rows == count
    if family == "gemma3":  # the image's tokens attend to each other both ways at prefill: marked by type 1
        assert torch.equal(inputs["token_type_ids"][0] == 1, ids == image_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_generate_is_deterministic(family: str, tiny_vlm_dirs: TinyVlmDirs) -> None:
    path = tiny_vlm_dirs[family]
    first = reference_generate(path, _messages(), [tiny_image(3)], 6)
    assert first == reference_generate(path, _messages(), [tiny_image(3)], 6)
    assert 0 < len(first) <= 6
    assert len(set(first)) > 1 or len(first) == 1  # a random model that does more than repeat one token


def test_the_image_changes_the_output(tiny_vlm_dirs: TinyVlmDirs) -> None:
    path = tiny_vlm_dirs["qwen2_vl"]
    assert reference_generate(path, _messages(), [tiny_image(3)], 8) != reference_generate(
        path, _messages(), [tiny_image(4)], 8
    )


def test_a_text_model_has_no_processor(tiny_model: LoadedModel, tiny_model_dir: Path) -> None:
    assert tiny_model.processor is None
    assert not is_vision_config(tiny_model.model.config)
    assert load_causal_lm(tiny_model_dir, dtype="fp32", device="cpu", load_format="dummy").processor is None


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_dummy_load_format(family: str, tiny_vlm_dirs: TinyVlmDirs) -> None:
    loaded = load_causal_lm(tiny_vlm_dirs[family], dtype="fp32", device="cpu", load_format="dummy")
    assert type(loaded.model).__name__ == MODEL_CLASSES[family]
    assert loaded.processor is not None
    assert loaded.processor.tokenizer is loaded.tokenizer


def test_a_vlm_without_its_image_processor_fails_to_load(tiny_vlm_dirs: TinyVlmDirs, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_vlm_dirs["llava"], broken)
    (broken / "processor_config.json").unlink()
    with pytest.raises(ModelLoadError, match="processor"):
        load_causal_lm(broken, dtype="fp32", device="cpu")


def test_a_processor_that_needs_a_missing_package_says_what_to_install(
    tiny_vlm_dirs: TinyVlmDirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmiserve.models import vision

    class NeedsTorchvision:
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
            raise ImportError("NeedsTorchvision requires the torchvision library but it was not found")

    monkeypatch.setattr(vision, "_processor_class", lambda path, config: NeedsTorchvision)
    with pytest.raises(ModelLoadError, match="torchvision") as raised:
        load_causal_lm(tiny_vlm_dirs["llava"], dtype="fp32", device="cpu")
    assert "pip install" in str(raised.value)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_an_images_only_processor_saves_as_its_transformers_class(family: str, tiny_vlm_dirs: TinyVlmDirs) -> None:
    """The Qwen-VL processors are built without their video processor, and still save (and so reload,
    with or without torchvision) as transformers' own class."""
    import json

    saved = json.loads((tiny_vlm_dirs[family] / "processor_config.json").read_text())
    assert saved["processor_class"] == MODEL_CLASSES[family].replace("ForConditionalGeneration", "Processor")
