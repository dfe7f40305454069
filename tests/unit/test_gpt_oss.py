"""gpt-oss (issue #39): served by lmiserve's forward (transformers' own forward over the KV blocks cannot take its
attention sinks), from its MXFP4 checkpoints as OpenAI publishes them (the experts dequantized at load; kept on a CPU
in fp32: test_cpu_experts.py); what it refuses, in one line. Its logits and greedy tokens against transformers', on every attention path, and its LoRA
adapters are in tests/unit/test_fast_llama.py, test_moe_fast.py and test_cuda_graphs.py (``gpt_oss``)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from helpers.llama_variants import MOE_ARCHS, PROMPTS, build, greedy_tokens, serve_prompts
from helpers.mxfp4 import write_mxfp4_gpt_oss
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return out, write_mxfp4_gpt_oss(out)


def test_an_mxfp4_checkpoint_is_dequantized_and_served_on_the_fast_forward(mxfp4_dir, caplog, monkeypatch):
    """Where the experts are de-quantized (a GPU where they fit, a CPU without numba: not kept, `cpu_experts.kept_for`
    False), the experts' MXFP4 blocks and scales become exactly the weights they encode; the model runs lmiserve's
    forward, its greedy tokens `generate()`'s, prompts in chunks of 4 beside decode rows."""
    from lmiserve.engine.model import cpu_experts

    monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)
    folder, state = mxfp4_dir
    with caplog.at_level(logging.INFO, logger="lmiserve.models.load"):
        loaded = load_causal_lm(folder, dtype="fp32", device="cpu")
    assert any("mxfp4 checkpoint: the experts'" in r.message for r in caplog.records)
    held = loaded.model.state_dict()
    for name, value in state.items():
        assert torch.equal(held[name], value), name
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 10))
    assert engine.runner.path == "fast"
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(loaded, prompt, 10)


def test_quantize_must_match_an_mxfp4_checkpoint(mxfp4_dir, tmp_path):
    folder, _ = mxfp4_dir
    with pytest.raises(ModelLoadError, match="quantize=fp8, but .* is a mxfp4 checkpoint"):
        load_causal_lm(folder, dtype="fp32", device="cpu", quantize="fp8")
    float_dir = tmp_path / "float"
    build(*MOE_ARCHS["gpt_oss"]).save_pretrained(float_dir)
    with pytest.raises(ModelLoadError, match="quantize=mxfp4: float is not a MXFP4 checkpoint"):
        load_causal_lm(float_dir, dtype="fp32", device="cpu", quantize="mxfp4")


def test_batch_invariant_gpt_oss_is_refused_in_one_line(tiny_model):
    """transformers' forward over the blocks cannot take its sinks, so `batch_invariant` (each row alone through
    transformers' forward) refuses it at start."""
    import dataclasses

    loaded = dataclasses.replace(tiny_model, model=build(*MOE_ARCHS["gpt_oss"]), max_context=256)
    with pytest.raises(ValueError, match="this model cannot be served") as refused:
        create_engine(loaded, EngineConfig(batch_invariant=True))
    assert "\n" not in str(refused.value)
