"""bf16 and weight-only int8 models (``dtype=bf16`` / ``dtype=int8``): quantization, loading, and greedy
parity with `model.generate` in the same dtype on the fast and the generic paths.

In bf16 two kernels round differently in the last bit, so a batched engine can break an exact or
near tie between two tokens differently from `generate` (as the README's "Dtypes on CPU" says). The
parity tests therefore require every sequence to equal `generate`'s tokens, or to leave them only at
a step where `generate`'s own logits put the two tokens within `TIE_ULPS` bf16 units of each other.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.fast_llama import unsupported_reason
from lmiserve.engine.quantize import Int8Linear, int8_linear, quantize_linears, quantize_weight
from lmiserve.models import ModelLoadError
from lmiserve.models.load import load_causal_lm, resolve_dtype

PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you",
    "Deep learning is",
    "def add(a, b):",
    "Once upon a time there",
    "What is the capital",
]
TOKENS = 16
TIE_ULPS = 2  # a divergence is a near tie when generate's two logits are this many bf16 units apart


def test_per_channel_symmetric_int8_round_trips_within_half_a_step():
    weight = torch.randn(48, 32) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different ranges
    q, scales = quantize_weight(weight)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(dim=1) == 127).all())  # each row uses its range
    error = (q.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())


def test_the_int8_product_is_the_dequantized_product_in_bf16():
    linear = torch.nn.Linear(64, 40, bias=True)
    module = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 64)
    y = module(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16
    expected = x.bfloat16().float() @ module.dequantized().T + module.bias.float()
    torch.testing.assert_close(y.float(), expected, rtol=0.02, atol=0.05)
    rows = x.reshape(-1, 64).bfloat16().t().contiguous().t()  # a transposed view: made contiguous for the kernel
    assert torch.equal(int8_linear(rows, module.weight, module.scales) + module.bias, y.reshape(15, 40))


def test_quantize_linears_keeps_the_output_projection_and_odd_sizes_float(tiny_model_dir: Path):
    loaded = load_causal_lm(tiny_model_dir, dtype="fp32", device="cpu")
    model = loaded.model
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(120, 64, bias=False)  # 120 % 16 != 0: the kernel's limit
    count = quantize_linears(model)
    layers = model.model.layers
    assert count == 7 * len(layers) - 1
    assert isinstance(layers[1].self_attn.q_proj, Int8Linear) and isinstance(layers[1].mlp.down_proj, Int8Linear)
    assert type(layers[0].mlp.down_proj) is torch.nn.Linear and layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_int8_loads_on_cpu_only_and_runs_the_fast_path(tiny_model_dir: Path):
    assert resolve_dtype("int8", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # auto never lowers precision on CPU
    with pytest.raises(ModelLoadError, match="int8"):
        resolve_dtype("int4", torch.device("cpu"))
    loaded = load_causal_lm(tiny_model_dir, dtype="int8", device="cpu")
    assert loaded.dtype == torch.bfloat16
    assert isinstance(loaded.model.model.layers[0].self_attn.o_proj, Int8Linear)
    assert unsupported_reason(loaded.model) is None
    engine = create_engine(loaded, EngineConfig())
    assert engine.runner.path == "fast"
    layer = engine.runner.fast.layers[0]
    assert layer.qkv_w.dtype == torch.int8 and layer.qkv_s is not None and layer.qkv_s.dtype == torch.bfloat16
    # the modules read rows of the fused matrices: generate and the fast path share the weights
    attn = loaded.model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == layer.qkv_w[attn.q_proj.out_features :].data_ptr()
    assert engine.runner.cache.keys[0].dtype == torch.bfloat16


def _generate(loaded, prompt: str) -> list[int]:
    ids = torch.tensor([loaded.tokenizer(prompt).input_ids])
    with torch.inference_mode():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            pad_token_id=3,
        )
    return out[0, ids.shape[1] :].tolist()


async def _serve(loaded, config: EngineConfig) -> tuple[str, list[list[int]]]:
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int, prompt: str) -> list[int]:
        await asyncio.sleep(0.01 * i)  # later requests join a running batch
        params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
        return [e.token.id async for e in engine.generate(GenerationRequest(prompt, params)) if e.token]

    try:
        return engine.runner.path, await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await engine.stop()


def _tie_gap(loaded, prompt: str, reference: list[int], got: list[int]) -> tuple[float, float]:
    """At the first token where `got` leaves `reference`: generate's logit gap between the two tokens,
    and TIE_ULPS bf16 units at that logit."""
    k = next(i for i, (a, b) in enumerate(zip(reference, got)) if a != b)
    ids = torch.tensor([loaded.tokenizer(prompt).input_ids + reference[:k]])
    with torch.inference_mode():
        logits = loaded.model(ids).logits[0, -1].float()
    top = float(logits[reference[k]])
    ulp = 2.0 ** (math.floor(math.log2(max(abs(top), 1e-3))) - 7)  # bf16: 8 significant bits
    return top - float(logits[got[k]]), TIE_ULPS * ulp


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "generic"])
def test_greedy_tokens_equal_generate_in_the_same_dtype_up_to_near_ties(tiny_model_dir: Path, dtype, fast_path):
    loaded = load_causal_lm(tiny_model_dir, dtype=dtype, device="cpu")
    path, results = asyncio.run(_serve(loaded, EngineConfig(fast_path=fast_path)))
    assert path == ("fast" if fast_path else "generic")
    equal = 0
    for prompt, got in zip(PROMPTS, results):
        reference = _generate(loaded, prompt)
        if got == reference:
            equal += 1
            continue
        gap, tie = _tie_gap(loaded, prompt, reference, got)
        assert 0 <= gap <= tie, (prompt, reference, got, gap)
    assert equal >= len(PROMPTS) - 2  # ties are rare: most sequences equal generate's tokens outright
