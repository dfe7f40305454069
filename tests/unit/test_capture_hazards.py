"""tests/helpers/capture_hazards.py: what a CUDA graph cannot capture is found on a CPU (the check every
fast-tier decode-graph step runs under, tests/conftest.py `graph_step_hazards`), and what it can is not."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import lmiserve
from helpers.capture_hazards import Hazards, watch

HAZARDS = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.sum() > 0),
    "if": lambda x: 1 if x.max() > 0 else 0,
    "int": lambda x: int(x[0].long()),
    "slice by a tensor": lambda x: x[: x[0].long().clamp(1, 2)],
    "tolist": lambda x: x.tolist(),
    "numpy": lambda x: x.numpy(),
    "cpu": lambda x: x.cpu(),
    "nonzero": lambda x: torch.nonzero(x > 0),
    "boolean mask": lambda x: x[x > 0],
    "boolean mask written": lambda x: x.clone().__setitem__(x > 0, 0.0),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "unique": lambda x: torch.unique(x.long()),
    "repeat_interleave": lambda x: torch.repeat_interleave(x, (x > 0).long()),
    "tensor of host data": lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "as_tensor": lambda x: x + torch.as_tensor([1.0, 2.0, 3.0, 4.0]),
    "from_numpy": lambda x: x + torch.from_numpy(np.ones(4, dtype=np.float32)),
}


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference"])
@pytest.mark.parametrize("name", list(HAZARDS))
def test_each_hazard_is_found_with_its_line(name, inference):
    """Inference mode too (the engine's): there aten keeps ``item`` and ``is_nonzero`` whole."""
    hazards = Hazards()
    x = torch.tensor([0.5, -1.0, 2.0, 3.0])
    with torch.inference_mode(inference):
        watch(hazards, HAZARDS[name], x)
    assert hazards.found, name
    assert all(where.startswith("test_capture_hazards.py:") for _, where in hazards.found), hazards.found


def test_what_a_graph_captures_is_not_a_hazard():
    def step(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.silu(x) @ x.t()  # ops on device tensors, allocations
        y = y.index_select(0, index) + x[index]  # gathers by device indices
        out = torch.empty(4, 4)
        out.copy_(torch.where(x > 0, x, -x))  # a mask used as a value, not an index
        marks = torch.zeros(4, 4, dtype=torch.bool)
        marks.index_put_((index, index), torch.ones((), dtype=torch.bool))  # a boolean put: a value, not an index
        marks[index] = x[index] > 0
        return torch.repeat_interleave(out.flatten(), 2, output_size=32) + y.sum() + x.shape[0]

    hazards = Hazards()
    with torch.inference_mode():
        watch(hazards, step, torch.randn(4, 4), torch.tensor([2, 0]).clone())
    assert hazards.found == []


COPIES = {  # host data on the device: (the copy, whether the host waits for it)
    "torch.tensor on the device": (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device), True),
    ".to the device": (lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device), True),
    ".to the device, non_blocking": (
        lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device, non_blocking=True),
        False,
    ),
    "from_numpy .to the device": (lambda x: x + torch.from_numpy(np.ones(4, np.float32)).to(x.device), True),
}


@pytest.mark.parametrize("name", list(COPIES))
def test_a_blocking_copy_to_the_device_is_a_wait_and_a_non_blocking_one_is_not(name):
    """Both are host data (a capture would record the copy once); the blocking one also makes the host wait
    (torch synchronizes the stream after it), which an eager step must not either. A tensor's own ``.to``
    of where it already is copies nothing."""
    copy, waits = COPIES[name]
    hazards = Hazards()
    x = torch.tensor([0.5, -1.0, 2.0, 3.0])
    watch(hazards, copy, x)
    assert hazards.host_data
    assert bool(hazards.syncs) is waits, hazards.syncs
    again = Hazards()
    watch(again, lambda t: t.to(t.device) + t.to(device=t.device, dtype=torch.float64), x)
    assert again.found == []


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a Triton kernel under the interpreter")
def test_a_triton_kernels_launch_under_the_interpreter_is_not_a_hazard():
    """On a GPU it is one launch a graph records; the interpreter's own host work does not count."""
    from lmiserve.engine.model import fused_norm

    hazards = Hazards()
    gate_up = torch.randn(3, 96)
    out = watch(hazards, fused_norm.silu_mul, gate_up, 48)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:])
    assert hazards.found == []


def test_a_host_sync_slipped_into_the_decode_graphs_step_fails_the_test(tiny_model, monkeypatch, graph_step_hazards):
    """The fast tier's check (tests/conftest.py): the engine's decode graphs' step with a host sync made on
    purpose (a value read on the host in the forward) is found, at its line, in a real engine's step."""
    import asyncio

    from helpers.decode_graphs import graphs_on_the_test_device
    from helpers.llama_variants import serve_prompts
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.model.fast_llama import FastLlama

    if graph_step_hazards is None:
        pytest.skip("on CUDA the capture itself is the check")
    body = FastLlama.decode_body

    def synced(self, ids, positions, meta, lora, out):  # noqa: ANN001, ANN202 - FastLlama.decode_body's
        if int(ids.max()) < 0:  # never true: the read is the hazard
            raise AssertionError
        return body(self, ids, positions, meta, lora, out)

    graphs_on_the_test_device(monkeypatch)
    monkeypatch.setattr(FastLlama, "decode_body", synced)
    asyncio.run(serve_prompts(tiny_model, EngineConfig(), 3))
    found = set(graph_step_hazards.found)
    graph_step_hazards.clear()  # made on purpose: not this test's failure
    assert {what for what, where in found if where.endswith("(synced)")} >= {"__int__"}, found


@pytest.mark.parametrize(
    "path,backend",
    [("fast", "triton"), ("fast", "torch"), ("generic", "triton"), ("generic", "torch")],
    ids=["fast-triton", "fast-torch", "generic-triton", "generic-torch"],
)
def test_an_eager_steps_forward_never_waits_for_the_device(tiny_model, monkeypatch, path, backend):
    """A step that runs eagerly on a GPU (a prompt chunk joining decode rows, rows whose logits are not all
    kept) copies its inputs to the device without waiting and reads nothing back: a blocking copy would make
    the host wait for all the GPU has queued (with overlap scheduling, the step before it) before it launches
    anything. The forward of the fast path and of transformers' over the blocks, each through the Triton
    kernel and through the torch attention over the gathered blocks (a GPU's without Triton; not the CPU's
    compiled kernel)."""
    import asyncio

    from helpers.llama_variants import serve_prompts
    from lmiserve.engine.attention import cpu_kernel
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.model.fast_llama import FastLlama
    from lmiserve.engine.runner.generic import PagedGenericRunner

    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", backend)
    monkeypatch.setattr(cpu_kernel, "available", lambda dtype, device: False)  # a GPU's torch attention
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and tiny_model.device.type != "cuda":
        pytest.skip("the Triton kernel runs on CUDA, or on a CPU under the interpreter")
    owner, name = (FastLlama, "forward") if path == "fast" else (PagedGenericRunner, "_forward")
    forward = getattr(owner, name)
    hazards, calls = Hazards(), []

    def watched(self, *args):  # noqa: ANN001, ANN202 - the forward's
        calls.append(1)
        return watch(hazards, forward, self, *args)

    monkeypatch.setattr(owner, name, watched)
    config = EngineConfig(fast_path=path == "fast", max_prefill_tokens=8)  # prompts in chunks beside decode rows
    engine, results = asyncio.run(serve_prompts(tiny_model, config, 6))
    assert engine.runner.path == path and len(calls) > 6 and all(results)
    attention = engine.runner.fast.attention if path == "fast" else engine.runner.attention
    assert (attention.name if attention is not None else "torch") == backend  # (generic: None, transformers')
    assert hazards.syncs == [], sorted(set(hazards.syncs))


def test_an_eager_step_with_lora_adapters_never_waits_for_the_device(tiny_model, lora_adapter_dirs, monkeypatch):
    """Steps with adapters run eagerly (without decode graphs, or beyond their slots): the rows' adapters
    and each layer's masks reach the device without a wait. The products a GPU runs (the masked stacked
    product; a CPU's compiled kernel and per-adapter gathering are the CPU's own)."""
    import asyncio

    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine
    from lmiserve.engine.lora import batch as lora_batch
    from lmiserve.engine.lora import kernels as lora_kernels
    from lmiserve.engine.lora.registry import LoraLimits
    from lmiserve.engine.model.fast_llama import FastLlama

    monkeypatch.setattr(lora_kernels, "available", lambda dtype, device: False)
    monkeypatch.setattr(lora_batch.LoraBatch, "_apply_gathered", lora_batch.LoraBatch._apply_stacked)
    forward = FastLlama.forward
    hazards, adapters = Hazards(), []

    def watched(self, step):  # noqa: ANN001, ANN202 - FastLlama.forward's
        adapters.append(0 if step.lora is None else len(step.lora.adapters))
        return watch(hazards, forward, self, step)

    monkeypatch.setattr(FastLlama, "forward", watched)

    async def run() -> list[list[int]]:
        engine = create_engine(tiny_model, EngineConfig(lora=LoraLimits(max_loras=3), max_prefill_tokens=8))
        assert engine.adapters is not None
        for name, path in lora_adapter_dirs.items():
            await asyncio.to_thread(engine.adapters.register, name, path)
        engine.start()
        try:

            async def one(name: str | None, i: int) -> list[int]:
                await asyncio.sleep(0.01 * i)
                params = SamplingParams(max_new_tokens=5, ignore_eos_token=True)
                request = GenerationRequest(f"adapter {i} says", params, adapter=name)
                return [e.token.id async for e in engine.generate(request) if e.token is not None]

            names = [*lora_adapter_dirs, None]
            return await asyncio.gather(*(one(name, i) for i, name in enumerate(names)))
        finally:
            await engine.stop()

    assert all(asyncio.run(run()))
    assert max(adapters) >= 2  # steps of several adapters and the base model
    assert hazards.syncs == [], sorted(set(hazards.syncs))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen3_vl", "gemma3"])
def test_a_vision_models_steps_never_wait_for_the_device(tiny_vlm_dir, monkeypatch, family):
    """A VLM's steps run eagerly (transformers' forward over the blocks, on embeddings): the step's image
    positions and feature rows are found on the host, where each request keeps them, and reach the device
    without a wait, as its ids and positions (M-RoPE: Qwen2-VL, Qwen3-VL's DeepStack, Gemma 3's both-ways
    image attention), and transformers' forward waits nowhere either (Qwen3-VL's DeepStack step, which
    indexes by a boolean mask, is the runner's own by positions). The encoding at admission waits only where
    transformers' encoder does (LLaVA and Gemma 3: nowhere)."""
    import asyncio

    from helpers.vlm_serving import chat, config, image_of, prompt_of, serve
    from lmiserve.engine.attention import cpu_kernel
    from lmiserve.engine.runner.generic import PagedGenericRunner
    from lmiserve.engine.runner.vision import PagedVisionRunner
    from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner
    from lmiserve.models.load import load_causal_lm

    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "torch")
    monkeypatch.setattr(cpu_kernel, "available", lambda dtype, device: False)  # a GPU's torch attention
    watched: dict[str, Hazards] = {}
    watches = (
        (PagedGenericRunner, "_forward"),
        (PagedVisionRunner, "_encode"),
        (PagedFastVisionRunner, "_with_images"),
        (PagedFastVisionRunner, "_rope_rows"),
    )
    for owner, name in watches:
        hazards, original = Hazards(), getattr(owner, name)
        watched[name] = hazards

        def watching(self, *args, _original=original, _hazards=hazards):  # noqa: ANN001, ANN202
            return watch(_hazards, _original, self, *args)

        monkeypatch.setattr(owner, name, watching)
    # on the GPU check's device too (LMISERVE_TEST_DEVICE): there the copies are real
    loaded = load_causal_lm(tiny_vlm_dir(family), dtype="fp32", device=os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
    requests = [
        (prompt_of(loaded, chat("Describe the picture.")), (image_of(1),)),
        (prompt_of(loaded, [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}]), ()),
        (prompt_of(loaded, chat("What colour is it?")), (image_of(2, (40, 56)),)),
    ]
    results, engine = asyncio.run(serve(loaded, config(max_prefill_tokens=8), requests))  # chunks split images
    assert all(tokens for tokens, _ in results)
    ours = {path.name for path in Path(lmiserve.__file__).parent.rglob("*.py")}  # lines are named by file name
    forward = watched["_forward"].syncs
    assert [w for w in forward if w[1].split(":")[0] in ours] == [], sorted(set(forward))
    assert forward == [], sorted(set(forward))
    if family in ("llava", "gemma3"):
        assert watched["_encode"].syncs == [], sorted(set(watched["_encode"].syncs))
        # their steps on lmiserve's forward (runner/vision_fast.py): the features placed without a wait
        assert engine.executor.runner.steps["fast"] > 0 and watched["_with_images"].syncs == []
    # M-RoPE image tokens' RoPE rows, made from their prompt's 3-D positions on the device (Qwen2-VL's)
    assert watched["_rope_rows"].syncs == [], sorted(set(watched["_rope_rows"].syncs))
    assert watched["_with_images"].syncs == [], sorted(set(watched["_with_images"].syncs))
