"""Triton's compilations after the warm-up are logged (engine/kernel_compiles.py): the hooks are Triton's
(``knobs.runtime``), driven here as Triton calls them (keyword arguments, before and after a compilation);
this CPU runs Triton's interpreter, which compiles nothing, so nothing is installed for real."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from lmiserve.engine import kernel_compiles


def compile_once(runtime: SimpleNamespace, key: str, name: str = "paged_attention_kernel") -> object:
    """What Triton's JIT does around one compilation: the cache hook (True: skip it), then the post hook."""
    info = {
        "key": key,
        "repr": f"{name}(stride_table: i32)",
        "fn": SimpleNamespace(name=name),
        "compile": {},
        "is_manual_warmup": False,
        "already_compiled": False,
    }
    skipped = runtime.jit_cache_hook(**info)
    if not skipped:
        runtime.jit_post_compile_hook(**info)
    return skipped


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Triton's runtime knobs, with hooks some other code set first (they must keep being called)."""
    calls: list[str] = []
    knobs = SimpleNamespace(
        jit_cache_hook=lambda **info: calls.append(f"before {info['key']}") or info["key"] == "skip",
        jit_post_compile_hook=lambda **info: calls.append(f"after {info['key']}"),
        calls=calls,
    )
    monkeypatch.setattr(kernel_compiles, "_watch", None)
    monkeypatch.setattr(kernel_compiles, "_knobs", lambda: knobs)
    return knobs


def test_a_compilation_after_the_warm_up_is_logged_with_its_kernel_and_counted(runtime, caplog):
    caplog.set_level(logging.WARNING, logger="lmiserve.engine.kernel_compiles")
    compile_once(runtime, "before")  # nothing watched yet
    assert kernel_compiles.watch() is True and kernel_compiles.watch() is True  # installed once
    with kernel_compiles.warming():
        compile_once(runtime, "a")  # during the warm-up: expected, not logged
    assert caplog.records == [] and kernel_compiles.after_warm_up() == 0
    compile_once(runtime, "b", "fp8_gemv_kernel")
    assert kernel_compiles.after_warm_up() == 1
    [record] = caplog.records
    message = record.getMessage()
    assert "Triton compiled fp8_gemv_kernel after the warm-up in " in message
    assert "fp8_gemv_kernel(stride_table: i32)" in message
    # the hooks that were there first still run, and a skip they ask for is kept (nothing compiles)
    assert compile_once(runtime, "skip") is True
    # a second model's warm-up (loaded at run time, while the first serves): its compilations are not logged
    with kernel_compiles.warming():
        compile_once(runtime, "c")
    assert kernel_compiles.after_warm_up() == 1 and len(caplog.records) == 1
    assert runtime.calls == [
        "before before", "after before", "before a", "after a", "before b", "after b", "before skip",
        "before c", "after c",
    ]  # fmt: skip


@pytest.mark.skipif(
    os.environ.get("LMISERVE_TEST_DEVICE", "cpu") == "cuda", reason="on a GPU Triton compiles (the test below)"
)
def test_nothing_is_watched_without_a_compiling_triton(monkeypatch):
    """Here Triton runs under its interpreter (tests/conftest.py): no hook is installed."""
    monkeypatch.setattr(kernel_compiles, "_watch", None)
    assert kernel_compiles._knobs() is None
    assert kernel_compiles.watch() is False
    with kernel_compiles.warming():
        pass
    assert kernel_compiles.after_warm_up() == 0


@pytest.mark.skipif(
    os.environ.get("LMISERVE_TEST_DEVICE", "cpu") != "cuda", reason="Triton compiles on a GPU (benchmarks/gpu_check.py)"
)
def test_on_a_gpu_tritons_own_hooks_report_a_compilation_after_the_warm_up(monkeypatch, caplog):
    """On CUDA, Triton itself calls the hooks: the attention kernel compiled for a shape nothing ran before."""
    import triton

    from lmiserve.engine.attention import triton_ops

    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", runtime.jit_cache_hook)  # restored after the test
    monkeypatch.setattr(runtime, "jit_post_compile_hook", runtime.jit_post_compile_hook)
    monkeypatch.setattr(kernel_compiles, "_watch", None)
    caplog.set_level(logging.WARNING, logger="lmiserve.engine.kernel_compiles")
    with kernel_compiles.warming():
        pass
    # 3 kv heads of 3 query heads each, of 24 dims, in blocks of 8: constexprs no other test launches
    assert triton_ops.self_check(3, 3, 24, 8, torch.float32, "cuda") is None
    assert kernel_compiles.after_warm_up() >= 1
    assert any("Triton compiled paged_attention_kernel after the warm-up in" in r.getMessage() for r in caplog.records)
