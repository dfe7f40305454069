"""The step contract's LoRA half (issue #36): a new request names its adapter as plain data (name, load id,
folder: `step.AdapterRef`), the runner's `LoraManager` reads and keeps the weights by that id, and the
registry tells it, through each batch's `dropped_adapters`, which loads it let go (unloaded past
`max_cpu_loras`, unregistered, updated from other files, once no request holds them), so the runner's side
keeps what the registry keeps. In one process the registry reads through the manager: one copy, which the
manager holds only while the registry or a request does."""

from __future__ import annotations

import asyncio
import gc
import pickle
import shutil

import pytest

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.core.step import AdapterRef, NewRequest, ScheduledTokens, StepBatch
from lmiserve.engine.factory import create_engine
from lmiserve.engine.lora.adapters import FAST_PATH_MODULES, AdapterError
from lmiserve.engine.lora.manager import LoraManager
from lmiserve.engine.lora.registry import AdapterRegistry, LoraLimits


def test_an_adapter_ref_is_plain_data(tiny_model, lora_adapter_dirs):
    manager = LoraManager(tiny_model.model, 16, FAST_PATH_MODULES)
    adapter = manager.load("alpha", lora_adapter_dirs["alpha"])
    ref = adapter.ref
    assert ref == AdapterRef("alpha", adapter.id, str(lora_adapter_dirs["alpha"]))
    new = NewRequest(1, [1, 2], SamplingParams(), 0, ref)
    assert pickle.loads(pickle.dumps(new)) == new  # crosses a process boundary as it is


def test_the_manager_reads_a_load_once_and_forgets_it_when_dropped(tiny_model, lora_adapter_dirs):
    manager = LoraManager(tiny_model.model, 16, FAST_PATH_MODULES)
    ref = AdapterRef("beta", 4242, str(lora_adapter_dirs["beta"]))
    first = manager.get(ref)
    assert first.id == 4242 and first.name == "beta" and first.rank == 4
    assert manager.get(ref) is first and manager.kept() == [4242]
    loaded = manager.load("alpha", lora_adapter_dirs["alpha"])  # the registry's loader: a new id, kept
    assert manager.kept() == sorted([4242, loaded.id]) and manager.get(loaded.ref) is loaded
    manager.drop([4242, 999])
    assert manager.kept() == [loaded.id]
    again = manager.get(ref)  # read again from its folder
    assert again is not first and again.id == 4242
    with pytest.raises(AdapterError, match="does not exist"):
        manager.get(AdapterRef("gone", 7, "/nowhere/at/all"))


def test_the_registry_names_the_loads_it_lets_go(tiny_model, lora_adapter_dirs):
    manager = LoraManager(tiny_model.model, 16, FAST_PATH_MODULES)
    registry = AdapterRegistry(tiny_model.model, LoraLimits(max_loras=1, max_cpu_loras=1), loader=manager.load)
    alpha = registry.register("alpha", lora_adapter_dirs["alpha"]).loaded
    assert alpha is not None and manager.get(alpha.ref) is alpha  # read once, through the manager
    beta = registry.register("beta", lora_adapter_dirs["beta"]).loaded
    assert beta is not None
    alpha_id = alpha.id
    assert registry.take_dropped() == [alpha_id]  # unloaded past max_cpu_loras
    assert registry.take_dropped() == []
    del alpha
    gc.collect()
    assert manager.kept() == [beta.id]  # its memory went with the registry's hold, before any step
    held = registry.acquire("beta")
    registry.unregister("beta")
    assert registry.take_dropped() == []  # a request still runs on it
    registry.release(held)
    assert registry.take_dropped() == [beta.id]
    gamma = registry.register("gamma", lora_adapter_dirs["gamma"]).loaded
    assert gamma is not None
    registry.update("gamma", src=lora_adapter_dirs["alpha"])
    assert registry.take_dropped() == [gamma.id]  # loaded again from other files
    registry.unregister("gamma")
    assert len(registry.take_dropped()) == 1


def _step(seq_id: int, ids: list[int], ref: AdapterRef | None, dropped: list[int] | None = None) -> StepBatch:
    return StepBatch(
        rows=[ScheduledTokens(seq_id, 0, ids, [seq_id], sample=True)],
        new=[NewRequest(seq_id, ids, SamplingParams(max_new_tokens=1), 0, ref)],
        dropped_adapters=dropped or [],
    )


def test_the_runner_fails_only_the_request_whose_adapter_does_not_load(tiny_model, lora_adapter_dirs, tmp_path):
    engine = create_engine(tiny_model, EngineConfig(lora=LoraLimits(), cpu_autotune=False))
    runner = engine.executor.runner
    assert runner.lora is not None
    folder = shutil.copytree(lora_adapter_dirs["alpha"], tmp_path / "alpha")
    ref = AdapterRef("alpha", 31337, str(folder))
    batch = _step(1, [5, 6, 7], ref)
    batch.rows.append(ScheduledTokens(2, 0, [5, 6, 7], [2], sample=True))
    batch.new.append(NewRequest(2, [5, 6, 7], SamplingParams(max_new_tokens=1), 0, AdapterRef("x", 1, "/nowhere")))
    out = runner.execute_batch(batch)
    assert set(out.samples) == {1} and "adapter `x` cannot be loaded" in out.errors[2]
    assert runner._requests[1].adapter.id == 31337 and 31337 in runner.lora.kept()
    shutil.rmtree(folder)  # kept: no read needed for the next steps of its requests
    runner.execute_batch(StepBatch(finished=[1, 2]))
    out = runner.execute_batch(_step(3, [8, 9], ref))
    assert set(out.samples) == {3}
    runner.execute_batch(StepBatch(finished=[3], dropped_adapters=[31337]))
    assert runner.lora.kept() == []


def test_the_engine_sends_the_dropped_loads_to_the_runner(tiny_model, lora_adapter_dirs):
    """With ``max_cpu_loras=1`` each adapter's load unloads the other's: the next batch drops it."""

    async def run():
        limits = LoraLimits(max_loras=1, max_cpu_loras=1)
        engine = create_engine(tiny_model, EngineConfig(lora=limits, cpu_autotune=False))
        runner = engine.executor.runner
        for name in ("alpha", "beta"):
            await asyncio.to_thread(engine.adapters.register, name, lora_adapter_dirs[name], preload=False)
        refs, dropped = [], []
        execute = runner.launch_batch

        def spy(batch):
            refs.extend(new.adapter for new in batch.new if new.adapter is not None)
            dropped.extend(batch.dropped_adapters)
            return execute(batch)

        runner.launch_batch = spy
        engine.start()
        try:
            params = SamplingParams(max_new_tokens=3, ignore_eos_token=True)
            for name in ("alpha", "beta", "alpha"):
                request = GenerationRequest("", params, prompt_ids=[5, 6, 7], adapter=name)
                _ = [e async for e in engine.generate(request)]
            return refs, dropped
        finally:
            await engine.stop()

    refs, dropped = asyncio.run(run())
    assert [ref.name for ref in refs] == ["alpha", "beta", "alpha"]
    assert len({ref.id for ref in refs}) == 3  # alpha loaded again: a new load
    assert dropped == [refs[0].id, refs[1].id]
