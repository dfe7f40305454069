"""The torch threads: the CPU models share one (its OpenMP team is built once), a GPU model gets its
own, so one model's forward never queues behind another's."""

from __future__ import annotations

import asyncio
import threading

import torch

from lmiserve.engine import torch_thread


def test_cpu_models_share_one_thread_and_gpu_models_get_their_own():
    assert torch_thread.for_device(torch.device("cpu"), "a") is torch_thread.SHARED
    assert torch_thread.for_device("cpu", "b") is torch_thread.SHARED
    first, second = torch_thread.for_device("cuda:0", "llm"), torch_thread.for_device(torch.device("cuda"), "emb")
    assert first is not second and torch_thread.SHARED not in (first, second)


async def test_a_gpu_models_work_does_not_wait_for_another_models():
    llm, embedder = torch_thread.for_device("cuda", "llm"), torch_thread.for_device("cuda", "embedder")
    release = threading.Event()
    try:
        busy = asyncio.ensure_future(llm.run(release.wait, 10))  # a long step on the LLM's thread
        names = await asyncio.wait_for(embedder.run(lambda: threading.current_thread().name), 5)
        assert names.startswith("lmiserve-torch-embedder") and not busy.done()
        release.set()
        assert await busy
        assert (await llm.run(lambda: threading.current_thread().name)).startswith("lmiserve-torch-llm")
    finally:
        release.set()
        llm.close()
        embedder.close()
    # closed, a thread starts again on its next use; the shared CPU thread is never closed
    assert (await llm.run(lambda: 7)) == 7
    llm.close()
    torch_thread.SHARED.close()
    assert (await torch_thread.run(lambda: threading.current_thread().name)).startswith("lmiserve-torch")


def test_engines_take_the_thread_of_their_device(tiny_model):
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.factory import create_engine

    engine = create_engine(tiny_model, EngineConfig())
    on_cpu = tiny_model.device.type == "cpu"  # LMISERVE_TEST_DEVICE=cuda puts it on a GPU
    assert (engine.thread is torch_thread.SHARED) == on_cpu
