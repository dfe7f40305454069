"""benchmarks/step_kernels.py: the kernels a decode graph's step launches, counted on a CPU (aten ops that
compute and Triton launches): with the fused kernels the rotation's kernel stores the keys and values, and the
backend's own write (its copies out of the q/k/v rows, its ``index_copy_``s, an fp8 cache's quantization) is
gone from every layer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmiserve.engine.attention import triton_ops
from lmiserve.engine.model import fused_norm

pytestmark = pytest.mark.skipif(not triton_ops.interpreting(), reason="counted under Triton's interpreter on a CPU")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def step_kernels():
    spec = importlib.util.spec_from_file_location("step_kernels", ROOT / "benchmarks" / "step_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_kernels"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["step_kernels"]


def a_layer(step_kernels, way: str, kv_dtype: torch.dtype | None, rows: int, arch: str = "llama") -> dict[str, float]:
    """What one layer adds to a step (of a model of 2 layers and of 1), by kernel."""
    one, two = (step_kernels.count(layers, way, kv_dtype, rows, arch) for layers in (1, 2))
    names = set(two.ops) | set(two.launches) | set(one.ops) | set(one.launches)
    made = {k: two.ops[k] + two.launches[k] - one.ops[k] - one.launches[k] for k in names}
    return {k: v for k, v in made.items() if v}


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kv", ["model", "e4m3"])
def test_the_rotations_kernel_stores_the_keys_and_values_in_place_of_the_backends_write(
    step_kernels, monkeypatch, rows, kv
):
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", None)  # (restored after: `count` sets them)
    monkeypatch.setattr(fused_norm, "wanted", fused_norm.wanted)
    kv_dtype = torch.float8_e4m3fn if kv == "e4m3" else None
    before = a_layer(step_kernels, "fused, rope alone", kv_dtype, rows)
    fused = a_layer(step_kernels, "fused", kv_dtype, rows)
    assert before["rope_store_kernel"] == 1 and before["index_copy_"] == 2  # the rotation alone, the backend's write
    assert fused["rope_store_kernel"] == 1 and fused["paged_attention_kernel"] == 1
    write = {"index_copy_", "reshape", "to", "clamp"}
    assert not write & set(fused)
    dropped = sum(before.values()) - sum(fused.values())
    assert dropped == sum(before[k] for k in write & set(before)) >= 2


def test_qwen3s_heads_are_normed_in_the_same_kernel(step_kernels, monkeypatch):
    """Qwen3's layer: its q and k heads' norms in the rotation's kernel too, no eager norm left (its square, mean
    and rsqrt), a layer as many kernels as Llama's."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(fused_norm, "USE_ON_CUDA", None)
    monkeypatch.setattr(fused_norm, "wanted", fused_norm.wanted)
    qwen3, llama = (a_layer(step_kernels, "fused", None, 1, arch) for arch in ("qwen3", "llama"))
    assert qwen3["rope_store_kernel"] == 1 and not {"pow", "mean", "rsqrt"} & set(qwen3)
    assert qwen3 == llama
