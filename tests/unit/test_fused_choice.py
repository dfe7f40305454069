"""engine/model/fused_choice.py: whether a decode step runs `fused_norm`'s kernels is measured on the device that
serves (here a CPU under Triton's interpreter, as tests/conftest.py sets it; on CUDA in CUDA graphs): both ways
checked against each other, then timed at each row count; a kernel that is off or fails is refused."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import pytest
import torch

from lmiserve.engine.attention import triton_ops
from lmiserve.engine.attention.paged import paged_cache
from lmiserve.engine.model import fast_llama, fused_choice, fused_norm, kernel_choice

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))
pytestmark = pytest.mark.skipif(
    not fused_norm.available() or not (DEVICE.type == "cuda" or triton_ops.interpreting()),
    reason="the kernels run on CUDA, or on a CPU under Triton's interpreter",
)
SHAPE = fused_choice.LayerShape(hidden=96, intermediate=80, rotated_heads=6, v_heads=2, head_dim=16, eps=1e-5)


@pytest.fixture
def fresh(monkeypatch):
    """No verdict kept from another test; the kernels allowed on this device and not forced either way."""
    monkeypatch.setattr(fused_choice, "_verdicts", {})
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", None)
    monkeypatch.setattr(fused_norm, "wanted", lambda device: True)


def test_both_ways_agree_and_are_timed_at_each_row_count(fresh):
    verdict = fused_choice.measure(SHAPE, torch.float32, DEVICE, rows=(1, 3))
    assert verdict.refused is None
    assert sorted(verdict.times_us) == [1, 3] and all(e > 0 and f > 0 for e, f in verdict.times_us.values())
    assert verdict.fused == all(f < e for e, f in verdict.times_us.values())
    assert verdict.as_dict()["times"]["3"].keys() == {"eager_us", "fused_us"}


def test_a_model_without_a_dense_mlp_or_the_rotation_measures_the_norms_alone(fresh):
    """An MoE model's layers (no dense MLP), a rotation the kernel does not make (GLM's by pairs, Phi-4-mini's
    partial one): the adds and norms."""
    shape = fused_choice.LayerShape(hidden=64, intermediate=0, rotated_heads=0, v_heads=2, head_dim=16, eps=1e-6)
    verdict = fused_choice.measure(shape, torch.float32, DEVICE, rows=(2,))
    assert verdict.refused is None and list(verdict.times_us) == [2]


@pytest.mark.parametrize("off", [1.0, 1.05])
def test_qwen3s_heads_norms_are_measured_with_the_rotation(fresh, monkeypatch, off):
    """Each q and k head normed before its rotation (Qwen3's), both ways: the same values, measured; the kernel's
    heads 5 % off (a norm's weight misread), refused."""
    shape = dataclasses.replace(SHAPE, head_norm=True)
    if off != 1.0:
        real = fused_norm.rope_store
        monkeypatch.setattr(fused_norm, "rope_store", lambda *a: real(*a) * off)
    verdict = fused_choice.measure(shape, torch.float32, DEVICE, rows=(2,))
    assert (verdict.refused is None) == (off == 1.0)
    assert off == 1.0 or verdict.refused == "the rotary embedding of q off by 0.05 at 2 row(s)"


def stores_off(real: Any) -> Any:
    """`fused_norm.rope_store` storing its keys 5 % off."""

    def run(*args: Any) -> torch.Tensor:
        q = real(*args)
        args[5].keys.mul_(1.05)  # (the `KvStore`)
        return q

    return run


@pytest.mark.parametrize(
    ("kernel", "named", "off"),
    [
        ("silu_mul", "SiLU and its product", None),
        ("rope_store", "the rotary embedding of q", None),
        ("rope_store", "the keys stored", stores_off),
    ],
)
def test_a_kernel_whose_values_are_off_is_refused(fresh, monkeypatch, kernel, named, off):
    """A kernel 5 % off (a GPU or Triton that miscompiles it) never serves, however fast: its output, or what it
    stores in the cache."""
    real = getattr(fused_norm, kernel)
    monkeypatch.setattr(fused_norm, kernel, (lambda *a: real(*a) * 1.05) if off is None else off(real))
    monkeypatch.setattr(kernel_choice, "time_gpu", lambda work, device: 0.0 if "_fused" in work.__qualname__ else 1.0)
    verdict = fused_choice.measure(SHAPE, torch.float32, DEVICE, rows=(2,))
    assert not verdict.fused and verdict.refused == f"{named} off by 0.05 at 2 row(s)"


def test_a_kernel_that_fails_keeps_the_eager_ops(fresh, monkeypatch):
    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(fused_norm, "add_rms_norm", broken)
    verdict = fused_choice.measure(SHAPE, torch.float32, DEVICE, rows=(1,))
    assert not verdict.fused and verdict.refused == "RuntimeError: out of resources: shared memory"


def test_the_shapes_of_a_model_and_what_the_forward_takes(fresh, tiny_model, monkeypatch, caplog):
    """A model's forward measures once for its shapes, takes the kernels where they are faster at every row count
    (the timer is told so: the interpreter is slower than eager ops), keeps the eager ops where one row count is
    slower, and a tensor-parallel rank never measures."""
    faster = {1: True, 16: True, 128: True}
    calls: list[tuple[str, int]] = []

    def timed(work: Any, device: torch.device) -> float:
        inputs = next(cell.cell_contents for cell in work.__closure__ if isinstance(cell.cell_contents, dict))
        fused, rows = "_fused" in work.__qualname__, inputs["x"].shape[0]
        calls.append(("fused" if fused else "eager", rows))
        return (0.5e-6 if faster[rows] else 2e-6) if fused else 1e-6

    monkeypatch.setattr(kernel_choice, "time_gpu", timed)
    cache = paged_cache(tiny_model.model, 4, 16)
    with caplog.at_level(logging.INFO, logger=fused_choice.__name__):
        fast = fast_llama.FastLlama(tiny_model.model, cache, 64)
    config = tiny_model.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert fused_choice.LayerShape.of(fast) == fused_choice.LayerShape(
        hidden=config.hidden_size, intermediate=config.intermediate_size, rotated_heads=heads + kv_heads,
        v_heads=kv_heads, head_dim=config.hidden_size // heads, eps=config.rms_norm_eps,
    )  # fmt: skip
    assert fast.fused_elementwise
    assert sorted(calls) == sorted((way, r) for way in ("eager", "fused") for r in fused_choice.ROWS)
    assert (
        f"runs the fused kernels (fused_norm), measured on {DEVICE} (1 row(s): fused 0.5 us, eager 1.0 us;"
        in caplog.text
    )
    assert fast_llama.FastLlama(tiny_model.model, cache, 64).fused_elementwise and len(calls) == 6  # kept

    monkeypatch.setattr(fused_choice, "_verdicts", {})
    faster[128] = False  # slower at a full batch: the eager ops
    assert not fast_llama.FastLlama(tiny_model.model, cache, 64).fused_elementwise
    shape = fused_choice.LayerShape.of(fast)
    assert not fused_choice.chosen(shape, torch.float16, DEVICE, tensor_parallel=True) and len(calls) == 12
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", True)  # LMISERVE_FUSED_ELEMENTWISE=1: forced, not measured
    assert fused_choice.chosen(shape, torch.float16, DEVICE, tensor_parallel=True) and len(calls) == 12


def test_the_environment_forces_the_kernels_on_or_off(monkeypatch):
    import importlib

    try:
        for value, want in (("1", True), ("0", False), ("", None), ("auto", None), (" Auto ", None)):
            monkeypatch.setenv("LMISERVE_FUSED_ELEMENTWISE", value)
            assert importlib.reload(fused_norm).USE_ON_CUDA is want
        monkeypatch.setenv("LMISERVE_FUSED_ELEMENTWISE", "0")
        assert not importlib.reload(fused_norm).wanted(torch.device("cuda"))
        monkeypatch.setenv("LMISERVE_FUSED_ELEMENTWISE", "true")  # not silently taken as unset: the start stops
        with pytest.raises(ValueError, match=r"LMISERVE_FUSED_ELEMENTWISE='true': expected 1 \(on\), 0 \(off\)"):
            importlib.reload(fused_norm)
    finally:
        monkeypatch.delenv("LMISERVE_FUSED_ELEMENTWISE")
        importlib.reload(fused_norm)
