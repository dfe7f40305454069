"""A quantized mixture of experts' checkpoint loaded twice, its experts de-quantized and kept quantized
(`engine/model/grouped_experts.py`'s kernels: `fp8_experts`, `int4_experts`), and the kept one served against the
de-quantized one's greedy tokens: what the kept experts' tests share."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.decode_graphs import graphs_on_the_test_device
from helpers.llama_variants import MOE_ARCHS, PROMPTS, build, greedy_tokens, serve_prompts
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.model import cpu_experts, grouped_experts

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
on_cpu_only = pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU's fp32 under the interpreter")


def kernel_runs(available: bool) -> pytest.MarkDecorator:
    """Skipped unless the kernel is `available` (Triton installed) and runs here: under Triton's interpreter
    (``TRITON_INTERPRET=1``, set by tests/conftest.py on CPU) or on a GPU."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return pytest.mark.skipif(
        not available or not (interpreted or DEVICE.type == "cuda"),
        reason="needs triton: its interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on CPU) or a GPU",
    )


def moe(arch: str, extra: dict | None = None) -> Any:
    """The tiny MoE of `llama_variants.MOE_ARCHS[arch]`, a Qwen3-MoE's with 64 inputs to down_proj (whole groups of
    32 and 64), `extra` over its config."""
    config_class, model_class, overrides = MOE_ARCHS[arch]
    inter = {"moe_intermediate_size": 64} if arch == "qwen3_moe" else {}
    return build(config_class, model_class, {**overrides, **inter, **(extra or {})})


def load_both(
    path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernel: Any
) -> tuple[Any, Any, Any, list[str]]:
    """The checkpoint in `path` loaded in fp32 on the CPU with its experts de-quantized (none kept: the CPU's own
    kernels, `cpu_experts`, not asked), then where the kernel module `kernel` keeps them (its `kept_for` forced), the
    decode graphs played on the CPU from then on: (the de-quantized model, the kept one, the graphs' record, the
    second start's log lines)."""
    from lmiserve.models.load import load_causal_lm

    monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)

    dequantized = load_causal_lm(path, dtype="fp32", device="cpu")
    assert not any(grouped_experts.kept(m) for m in dequantized.model.modules())
    record = graphs_on_the_test_device(monkeypatch)
    monkeypatch.setattr(kernel, "kept_for", lambda model, device, name: True)
    caplog.clear()
    with caplog.at_level("INFO", logger="lmiserve.models.load"):
        loaded = load_causal_lm(path, dtype="fp32", device="cpu")
    return dequantized, loaded, record, [r.getMessage() for r in caplog.records]


def serve_counted(loaded: Any, dequantized: Any, monkeypatch: pytest.MonkeyPatch, kernel: Any) -> tuple[Any, list[int]]:
    """`loaded` served (the engine, prompts joining a running batch, 8 greedy tokens each), each prompt's tokens
    `dequantized`'s `generate()` gives; (the engine, the rows of each call of `kernel.grouped_product`)."""
    ran: list[int] = []
    product = kernel.grouped_product
    monkeypatch.setattr(kernel, "grouped_product", lambda x, *rest: ran.append(x.shape[0]) or product(x, *rest))
    return served_as(loaded, dequantized), ran


def served_as(loaded: Any, reference: Any) -> Any:
    """`loaded` served (the engine, prompts joining a running batch, 8 greedy tokens each), each prompt's tokens
    `reference`'s `generate()` gives; the engine."""
    loaded = dataclasses.replace(loaded, max_context=256)
    engine, results = asyncio.run(serve_prompts(loaded, EngineConfig(max_prefill_tokens=4), 8))
    for prompt, events in zip(PROMPTS, results, strict=True):
        assert [e.token.id for e in events if e.token] == greedy_tokens(reference, prompt, 8), prompt
    return engine


def rank_blocks(
    model: Any, path: Path, monkeypatch: pytest.MonkeyPatch, kernel: Any, world: int = 2
) -> list[tuple[Any, list[Any]]]:
    """Each layer's MoE block of `model`'s checkpoint in `path` de-quantized whole in one process, and of each of
    `world` tensor-parallel ranks read with their experts where the kernel module `kernel` keeps them (its `kept_for`
    forced)."""
    from helpers.rank_shards import read_ranks
    from lmiserve.engine.model.layout_variants import moe_block
    from lmiserve.models.load import load_causal_lm
    from lmiserve.models.quantized_load import checkpoint_quantization

    if kernel is not cpu_experts:
        monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)
    with monkeypatch.context() as whole_load:  # (de-quantized whole)
        whole_load.setattr(cpu_experts, "kept_for", lambda *args: False)
        whole = load_causal_lm(path, dtype="fp32", device="cpu").model
    monkeypatch.setattr(kernel, "kept_for", lambda *args: True)
    ranks = read_ranks(model, path, world, checkpoint_quantization(path, None))
    layers = enumerate(whole.model.layers)
    return [(moe_block(layer), [moe_block(shell.model.layers[i]) for shell in ranks]) for i, layer in layers]


def assert_ranks_sum(block: Any, parts: list[Any], hidden: int) -> None:
    """The ranks' MoE blocks `parts` (what the all-reduce adds) give the whole `block`'s output on random rows of
    `hidden` values."""
    import torch

    from lmiserve.engine.model.layout_variants import moe_forward

    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        total, want = sum(moe_forward(part, x) for part in parts), moe_forward(block, x)
    largest = max(1.0, want.abs().max().item())  # (fp32's rounding of outputs in the hundreds: gpt-oss's)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5 * largest)


def assert_widened(parts: list[Any], kernel: str, pads: list[tuple[int, int]] | None, own: int, unit: int = 1) -> None:
    """Each rank's MoE block in `parts` keeps its experts on `kernel` (`pads` None: de-quantized, all of them), its
    down_proj's inputs its `own` widened to whole blocks by its pad (before, after: `expert_matrices.WholeBlocks`),
    stored `unit` inputs an element (two a byte, eight a word)."""
    for part, pad in zip(parts, pads or [None] * len(parts), strict=True):
        assert grouped_experts.kept(part.experts, kernel) is (pad is not None)
        if pad is not None:
            assert part.experts.__dict__["kept_down_pad"] == pad
            assert part.experts.down_proj.shape[2] == (own + sum(pad)) // unit
