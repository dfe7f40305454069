"""Managing adapters while requests run on them (lmiserve.models.adapters over a real engine): a request
running on an adapter that is unregistered, or loaded again from other files, finishes on the weights
it started with, token for token; a new request naming an unregistered adapter is refused; the engine's
snapshot names the adapters of the running and waiting requests (vLLM's lora_requests_info)."""

from __future__ import annotations

import contextlib

import pytest

from lmiserve.config import Settings
from lmiserve.core.errors import AdapterNotFound, Conflict, InvalidRequest
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import AsyncEngine, EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.engine.lora.registry import LoraLimits
from lmiserve.models import adapters
from lmiserve.models.service import ModelService

PROMPT = "The quick brown fox"
TOKENS = 48


@contextlib.asynccontextmanager
async def lora_service(tiny_model, tiny_model_dir):
    """A ready ModelService over an engine of `tiny_model` serving adapters."""
    engine = create_engine(tiny_model, EngineConfig(lora=LoraLimits(max_loras=2, max_lora_rank=16)))
    service = ModelService(Settings(model_id=str(tiny_model_dir), enable_lora=True))
    service.attach_llm(tiny_model, engine)
    service.status = ModelService.READY
    engine.start()
    try:
        yield service, engine
    finally:
        await engine.stop()


def request(adapter: str | None) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True)
    return GenerationRequest(PROMPT, params, adapter=adapter)


async def tokens(engine: AsyncEngine, adapter: str | None) -> list[int]:
    return [e.token.id async for e in engine.generate(request(adapter)) if e.token is not None]


async def test_unregistering_lets_running_requests_finish_on_the_adapter(tiny_model, tiny_model_dir, lora_adapter_dirs):
    roots = [lora_adapter_dirs["alpha"].parent.resolve()]
    async with lora_service(tiny_model, tiny_model_dir) as (service, engine):
        await adapters.register(service, "alpha", str(lora_adapter_dirs["alpha"]), roots=roots)
        with pytest.raises(Conflict):
            await adapters.register(service, "alpha", str(lora_adapter_dirs["beta"]), roots=roots)
        expected = await tokens(engine, "alpha")
        assert expected != await tokens(engine, None)  # the adapter changes the output

        got: list[int] = []
        async for event in engine.generate(request("alpha")):
            if event.token is None:
                continue
            got.append(event.token.id)
            if len(got) == 3:
                snap = engine.snapshot()
                assert (snap.lora_running, snap.max_loras) == (("alpha",), 2)
                adapters.unregister(service, "alpha")  # mid-stream
                assert service.adapters is not None and service.adapters.running() == {"alpha": 1}
        assert got == expected  # finished, on alpha's weights
        assert service.adapters.running() == {} and engine.snapshot().lora_running == ()

        with pytest.raises(AdapterNotFound):
            await tokens(engine, "alpha")
        with pytest.raises(AdapterNotFound):
            adapters.unregister(service, "alpha")


async def test_loading_again_from_other_files_lets_running_requests_finish_on_the_old(
    tiny_model, tiny_model_dir, lora_adapter_dirs
):
    roots = [lora_adapter_dirs["alpha"].parent.resolve()]
    async with lora_service(tiny_model, tiny_model_dir) as (service, engine):
        await adapters.register(service, "x", str(lora_adapter_dirs["alpha"]), roots=roots)
        alpha = await tokens(engine, "x")
        await adapters.register(service, "b", str(lora_adapter_dirs["beta"]), roots=roots)
        beta = await tokens(engine, "b")
        got: list[int] = []
        async for event in engine.generate(request("x")):
            if event.token is not None:
                got.append(event.token.id)
                if len(got) == 2:
                    await adapters.update(service, "x", roots=roots, src=str(lora_adapter_dirs["beta"]))
        assert got == alpha
        assert await tokens(engine, "x") == beta  # new requests get the new weights


async def test_registration_needs_a_served_root_and_enable_lora(tiny_model, tiny_model_dir, lora_adapter_dirs):
    from lmiserve.core.errors import Forbidden

    async with lora_service(tiny_model, tiny_model_dir) as (service, _):
        with pytest.raises(Forbidden):
            await adapters.register(service, "alpha", str(lora_adapter_dirs["alpha"]), roots=[tiny_model_dir])
        with pytest.raises(Forbidden):
            await adapters.register(service, "alpha", str(lora_adapter_dirs["alpha"]), roots=[])
    plain = ModelService(Settings(model_id=str(tiny_model_dir)))
    plain.status = ModelService.READY
    with pytest.raises(InvalidRequest, match="enable_lora=true"):
        adapters.adapters_of(plain)


async def test_pinned_adapters_leave_room_in_memory(tiny_model, tiny_model_dir, lora_adapter_dirs):
    roots = [lora_adapter_dirs["alpha"].parent.resolve()]
    async with lora_service(tiny_model, tiny_model_dir) as (service, _):  # max_cpu_loras = max_loras = 2
        await adapters.register(service, "p1", str(lora_adapter_dirs["alpha"]), roots=roots, pin=True)
        await adapters.register(service, "p2", str(lora_adapter_dirs["beta"]), roots=roots, pin=True)
        with pytest.raises(InvalidRequest, match=r"max_cpu_loras \(2\)"):
            await adapters.register(service, "p3", str(lora_adapter_dirs["gamma"]), roots=roots, pin=True)
        await adapters.update(service, "p1", roots=roots, pin=True)  # already pinned: no change, no refusal
        await adapters.update(service, "p2", roots=roots, pin=False)
        await adapters.register(service, "p3", str(lora_adapter_dirs["gamma"]), roots=roots, pin=True)
