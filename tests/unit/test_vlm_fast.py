"""A vision-language model's decoder on lmiserve's own forward (runner/vision_fast.py): which families take it,
which steps it runs (every one, but a Gemma 3 image's and an adapter's), the image features in place, its decode
graphs (replayed without a capture on a CPU, tests/helpers/decode_graphs.py), and a text config's soft cap that
the VLM's forward does not apply. Greedy output against generate() for every family: tests/unit/test_vlm_engine.py,
which runs these runners by default."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from helpers.decode_graphs import graphs_on_the_test_device
from helpers.tiny_vlm import FAMILIES
from helpers.vlm_serving import (
    chat,
    config,
    forward_prompt_logprobs,
    image_of,
    prompt_of,
    reference,
    same,
    serve,
    served_prompt_logprobs,
)
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.factory import create_engine
from lmiserve.engine.model.language_model import language_model
from lmiserve.engine.model.layout_variants import Multipliers
from lmiserve.engine.runner.vision import PagedVisionRunner
from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner, fast_vision_reason
from lmiserve.models.load import load_causal_lm

FAST = ("llava", "llava_next", "idefics3", "gemma3")  # a Llama-family decoder (Llama, Mistral, Gemma 3)


def _requests(loaded):  # noqa: ANN001, ANN202
    return [
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),)),
        (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ()),
        (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),)),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_families_whose_decoder_the_fast_forward_runs(tiny_vlm_dir, family):
    loaded = load_causal_lm(tiny_vlm_dir(family), dtype="fp32", device="cpu")
    runner = create_engine(loaded, config()).executor.runner
    reason = fast_vision_reason(loaded.model, fast_path=True)
    if family in FAST:
        assert reason is None and isinstance(runner, PagedFastVisionRunner) and runner.path == "fast"
    else:  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL
        assert reason == "a vision-language model with M-RoPE positions"
        assert type(runner) is PagedVisionRunner and runner.path == "generic"
    for off in (config(fast_path=False), config(batch_invariant=True)):
        assert type(create_engine(loaded, off).executor.runner) is PagedVisionRunner


@pytest.mark.parametrize("family", FAST)
def test_which_steps_run_the_fast_forward(tiny_vlm_dir, family):
    """Every step on the fast forward, the image features in place (chunks of 8 split LLaVA's images); Gemma 3's
    steps that meet an image on the VLM's (its image tokens attend both ways), its other steps on the fast one."""
    path = tiny_vlm_dir(family)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    requests = _requests(loaded)
    results, engine = asyncio.run(serve(loaded, config(max_prefill_tokens=8), requests))
    assert same(results, [reference(path, *r) for r in requests]), family
    steps = engine.executor.runner.steps
    assert steps["fast"] > 0
    assert (steps["vlm"] > 0) == (family == "gemma3"), steps


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_decode_graphs_serve_a_vlm(tiny_vlm_dir, monkeypatch, family):
    made = graphs_on_the_test_device(monkeypatch)
    path = tiny_vlm_dir(family)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    requests = _requests(loaded)
    results, engine = asyncio.run(serve(loaded, config(), requests))
    runner = engine.executor.runner
    assert isinstance(runner, PagedFastVisionRunner) and cuda_graphs.of_runner(runner) is made.made[-1]
    assert runner.kv.num_blocks == runner.num_blocks + 1  # the graphs' scratch block, which no sequence holds
    assert len(made.steps) > 0, "no decode step replayed the graphs"
    assert same(results, [reference(path, *r) for r in requests]), family


def test_the_text_configs_soft_cap_is_not_applied(tiny_vlm_dir, tmp_path):
    """Gemma 3's text config may name a final soft cap, which Gemma3ForCausalLM applies and the VLM's forward
    does not: the served prompt logprobs are the VLM's."""
    path = tmp_path / "gemma3-capped"
    shutil.copytree(tiny_vlm_dir("gemma3"), path)
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["text_config"]["final_logit_softcapping"] = 1.0  # far below these logits: a cap would change them all
    config_file.write_text(json.dumps(saved))
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    assert loaded.model.config.text_config.final_logit_softcapping == 1.0
    view = language_model(loaded.model)
    assert view is not None and Multipliers.of(view).softcap is None
    # a text prompt: its step runs on the fast forward (a Gemma 3 image's runs the VLM's)
    prompt = prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there, who are you?"}]}])
    ids, expected = forward_prompt_logprobs(path, prompt, ())
    served, got = asyncio.run(served_prompt_logprobs(loaded, config(), prompt, ()))
    assert served == ids
    assert torch.allclose(got, expected, atol=1e-4), float((got - expected).abs().max())
