"""A vision-language model's decoder on lmiserve's own forward (runner/vision_fast.py): which families take it,
which steps it runs (every one; adapters': tests/unit/test_vlm_lora.py), the image features in place, its decode
graphs (replayed without a capture on a CPU, tests/helpers/decode_graphs.py), and a text config's soft cap that
the VLM's forward does not apply. Greedy output against generate() for every family: tests/unit/test_vlm_engine.py,
which runs these runners by default."""

from __future__ import annotations

import asyncio
import json
import os
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

MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# the decode graphs' tests on the GPU check's device (LMISERVE_TEST_DEVICE: there they capture); the rest on a CPU
DEVICE = os.environ.get("LMISERVE_TEST_DEVICE", "cpu")


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
    assert fast_vision_reason(loaded.model, fast_path=True) is None
    assert isinstance(runner, PagedFastVisionRunner) and runner.path == "fast"
    for off in (config(fast_path=False), config(batch_invariant=True)):
        assert type(create_engine(loaded, off).executor.runner) is PagedVisionRunner


@pytest.mark.parametrize("family", FAMILIES)
def test_which_steps_run_the_fast_forward(tiny_vlm_dir, family):
    """Every step on the fast forward, the image features in place (chunks of 8 split LLaVA's images), M-RoPE's
    text at its shifted positions (a generated token's rotated at its position plus the prompt's rope delta) and
    its images' tokens at their 3-D positions, Qwen3-VL's DeepStack features added after its first layers, Gemma 3's
    image tokens seeing each other both ways (over the torch attention); no step on the VLM's forward."""
    path = tiny_vlm_dir(family)
    loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    requests = _requests(loaded)
    results, engine = asyncio.run(serve(loaded, config(max_prefill_tokens=8), requests))
    assert same(results, [reference(path, *r) for r in requests]), family
    steps = engine.executor.runner.steps
    assert steps["fast"] > 0
    assert steps["vlm"] == 0, steps


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl", "qwen3_vl"])
def test_decode_graphs_serve_a_vlm(tiny_vlm_dir, monkeypatch, family):
    made = graphs_on_the_test_device(monkeypatch)
    path = tiny_vlm_dir(family)
    loaded = load_causal_lm(path, dtype="fp32", device=DEVICE)
    requests = _requests(loaded)
    results, engine = asyncio.run(serve(loaded, config(), requests))
    runner = engine.executor.runner
    assert isinstance(runner, PagedFastVisionRunner) and cuda_graphs.of_runner(runner) is made.made[-1]
    assert runner.kv.num_blocks == runner.num_blocks + 1  # the graphs' scratch block, which no sequence holds
    assert len(made.steps) > 0, "no decode step replayed the graphs"
    assert (made.shifted > 0) == (family in MROPE)  # (the tiny images take fewer positions than tokens)
    assert same(results, [reference(path, *r) for r in requests]), family


def test_prompt_chunks_folded_into_the_graphs_take_their_shifts(tiny_vlm_dir, monkeypatch):
    """With `cuda_graph_prompt_tokens`, a Qwen2.5-VL prompt's text chunks past its image (chunks of 6) replay the
    decode graphs a token a row, each rotated at its shifted position."""
    made = graphs_on_the_test_device(monkeypatch)
    path = tiny_vlm_dir("qwen2_5_vl")
    loaded = load_causal_lm(path, dtype="fp32", device=DEVICE)
    requests = _requests(loaded)
    results, _ = asyncio.run(serve(loaded, config(max_prefill_tokens=6, graph_prompt_tokens=6), requests))
    assert same(results, [reference(path, *r) for r in requests])
    assert made.shifted > 0


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


def _mistral3():  # noqa: ANN202
    """A tiny random Mistral 3 (Mistral Small 3.1's architecture: Pixtral vision, Mistral text)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {
        "model_type": "mistral",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=90)
    torch.manual_seed(5)
    return Mistral3ForConditionalGeneration(config).eval()


@torch.inference_mode()
def test_a_mistral3_decoder_with_image_features_in_place_gives_the_vlms_logits():
    """The fast forward over a Mistral 3's decoder: a prompt whose positions 3-6 take image features (as the
    VLM's forward places them: their tokens' embeddings replaced) gives the logits of the VLM's decoder and head
    on those embeddings; then a decode step over the blocks, its next token's."""
    from lmiserve.engine.attention.paged import paged_cache
    from lmiserve.engine.model.fast_llama import FastLlama, StepInputs

    vlm = _mistral3()
    assert fast_vision_reason(vlm, fast_path=True) is None
    view = language_model(vlm)
    assert view is not None and view.model is vlm.model.language_model
    ids = [1, 7, 9, 90, 90, 90, 90, 12, 30, 41]
    features = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    embeds = vlm.get_input_embeddings()(torch.tensor([ids]))
    embeds[0, 3:7] = features
    hidden = vlm.model.language_model(inputs_embeds=embeds).last_hidden_state
    reference = vlm.lm_head(hidden)[0]
    fast = FastLlama(view, paged_cache(vlm, 4, 4), 64)  # type: ignore[arg-type]
    table = [2, 0, 3]
    prompt = [0 if t == 90 else t for t in ids[:-1]]
    out = fast.forward(
        StepInputs(chunks=[(table, 0, prompt)], keep=list(range(9)), embeds=(torch.arange(3, 7), features))
    )
    torch.testing.assert_close(out, reference[:9], rtol=1e-4, atol=1e-4)
    out = fast.forward(StepInputs([ids[-1]], [len(ids) - 1], [table], keep=[0]))
    torch.testing.assert_close(out[0], reference[9], rtol=1e-4, atol=1e-4)
