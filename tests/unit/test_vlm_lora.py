"""LoRA adapters on a vision-language model's decoder (runner/vision_fast.py): served by lmiserve's own forward (the
fast forward's groups, named by the decoder's paths in the VLM; no step on transformers' forward of the VLM), the
greedy tokens of an image prompt with the adapter, beside the same prompt without it and a text prompt with it, are
transformers' `generate()`'s with the adapter merged by PEFT, for every family; in the decode graphs too (replayed
without a capture on a CPU). An adapter saved under an older transformers' module names (LLaVA's
``language_model.model.layers.``) is found by transformers' renamings; one that adapts the vision tower is refused
in one line. Over tensor parallelism: tests/integration/test_tensor_parallel_vlm_engine.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from helpers.decode_graphs import graphs_on_the_test_device
from helpers.tiny_vlm import FAMILIES
from helpers.vlm_adapters import make_vlm_adapter, merged_vlm_generate, renamed_adapter
from helpers.vlm_serving import KV, chat, image_of, reference
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.lora.adapters import AdapterError
from lmiserve.engine.lora.registry import LoraLimits
from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner
from lmiserve.models.load import load_causal_lm

TOKENS = 6
DEVICE = os.environ.get("LMISERVE_TEST_DEVICE", "cpu")  # (the decode graphs' test: on the GPU check's device)
TEXT = [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]


def _serve(loaded: Any, adapters: dict[str, Path], jobs: list[tuple[Any, tuple[Any, ...], str | None]]) -> Any:
    """Each job's greedy tokens (a prompt, its images, its adapter: None for none), all at once; and the runner."""
    engine = create_engine(loaded, EngineConfig(kv_cache_memory_bytes=KV, lora=LoraLimits(), cpu_autotune=False))
    assert engine.adapters is not None
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))

    async def run() -> list[list[int]]:
        engine.start()
        try:

            async def one(prompt: Any, images: tuple[Any, ...], adapter: str | None) -> list[int]:
                params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
                request = GenerationRequest(prompt, params, images=images, adapter=adapter)
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            return list(await asyncio.gather(*(one(*job) for job in jobs)))
        finally:
            await engine.stop()

    return asyncio.run(run()), engine.executor.runner


def _jobs(loaded: Any) -> list[tuple[Any, tuple[Any, ...], str | None]]:
    processor = loaded.processor
    image_prompt = processor.apply_chat_template(
        chat("Describe the picture."), add_generation_prompt=True, tokenize=False
    )
    text_prompt = processor.apply_chat_template(TEXT, add_generation_prompt=True, tokenize=False)
    return [(image_prompt, (image_of(1),), "tuned"), (image_prompt, (image_of(1),), None), (text_prompt, (), "tuned")]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_of_a_vlms_decoder_gives_the_merged_models_tokens(tiny_vlm_dir, tmp_path, family):
    path = tiny_vlm_dir(family)
    adapter = make_vlm_adapter(path, tmp_path / "tuned", r".*(language_model|text_model).*\.(q_proj|v_proj|down_proj)")
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    (tuned, base, text), runner = _serve(loaded, {"tuned": adapter}, _jobs(loaded))
    image = image_of(1).pixels
    # (generate() stops at EOS, the engine here ignores it: each reference begins the served tokens)
    merged = merged_vlm_generate(path, adapter, chat("Describe the picture."), [image], TOKENS)
    assert tuned[: len(merged)] == merged
    expected = reference(path, _jobs(loaded)[1][0], (image_of(1),))
    assert base[: len(expected)] == expected
    merged_text = merged_vlm_generate(path, adapter, TEXT, [], TOKENS)
    assert text[: len(merged_text)] == merged_text
    assert tuned != base  # (the adapter changes the answer)
    assert isinstance(runner, PagedFastVisionRunner) and runner.steps["vlm"] == 0, runner.steps


def test_decode_graphs_carry_a_vlms_adapters(tiny_vlm_dir, tmp_path, monkeypatch):
    made = graphs_on_the_test_device(monkeypatch)
    path = tiny_vlm_dir("qwen2_5_vl")
    adapter = make_vlm_adapter(path, tmp_path / "tuned")
    loaded = load_causal_lm(path, dtype="fp32", device=DEVICE)
    (tuned, _, _), runner = _serve(loaded, {"tuned": adapter}, _jobs(loaded))
    assert len(made.steps) > 0, "no decode step replayed the graphs"
    merged = merged_vlm_generate(path, adapter, chat("Describe the picture."), [image_of(1).pixels], TOKENS)
    assert tuned[: len(merged)] == merged
    assert runner.steps["vlm"] == 0


def test_an_adapter_saved_under_older_module_names_is_found(tiny_vlm_dir, tmp_path):
    """An adapter of LLaVA saved before transformers moved its decoder (``language_model.model.layers.``, now
    ``model.language_model.layers.``) serves as the same adapter under today's names."""
    path = tiny_vlm_dir("llava")
    adapter = make_vlm_adapter(path, tmp_path / "tuned")
    old = renamed_adapter(
        adapter, tmp_path / "old", "base_model.model.language_model.model.", "base_model.model.model.language_model."
    )
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    jobs = [(j[0], j[1], name) for j, name in zip(_jobs(loaded)[:2], ("tuned", "old"))]
    (tuned, legacy), _ = _serve(loaded, {"tuned": adapter, "old": old}, jobs)
    assert legacy == tuned


def test_an_adapter_of_the_vision_tower_is_refused_naming_its_module(tiny_vlm_dir, tmp_path):
    path = tiny_vlm_dir("llava")
    adapter = make_vlm_adapter(path, tmp_path / "everywhere", ["q_proj", "v_proj"])  # (CLIP's too)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    engine = create_engine(loaded, EngineConfig(kv_cache_memory_bytes=KV, lora=LoraLimits(), cpu_autotune=False))
    assert engine.adapters is not None
    with pytest.raises(
        AdapterError, match=r"adapts model\.vision_tower\..*outside the vision-language model's decoder"
    ) as refused:
        engine.adapters.register("everywhere", str(adapter))
    assert "\n" not in str(refused.value)
