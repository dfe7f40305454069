"""The LLM as a TensorModel (a BYTES tensor of prompts -> text_output) on the real tiny model's engine,
and the model registry the routes resolve models through."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lmiserve.config import Settings
from lmiserve.core.errors import (
    AdapterNotFound,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    ModelRequired,
    NoTextModel,
)
from lmiserve.core.parameters import Limits
from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.core.tensors import TensorRequest
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine
from lmiserve.models.llm_tensor import LlmTensorModel
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService


def texts(array: np.ndarray) -> list[str]:
    assert array.dtype == object
    return [b.decode() for b in array]


async def complete(engine, prompt: str, **params) -> str:
    async for event in engine.generate(GenerationRequest(prompt, SamplingParams(**params))):
        if event.finish is not None:
            return event.finish.generated_text
    raise AssertionError("no final event")


@pytest.fixture
async def engine(tiny_model):
    engine = create_engine(tiny_model, EngineConfig(max_running=8))
    engine.start()
    yield engine
    await engine.stop()


def prompts(*values: str) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode() for v in values]
    return out


async def test_rows_are_generated_concurrently_and_equal_single_requests(engine):
    model = LlmTensorModel(engine, Limits(default_max_new_tokens=8))
    rows = ["Hello world", "The quick brown fox", "Once upon a time"]
    steps_before = engine.steps
    out = await model.infer(TensorRequest({"text_input": prompts(*rows)}, parameters={"max_new_tokens": 6}))
    batched_steps = engine.steps - steps_before
    assert list(out) == ["text_output"] and out["text_output"].shape == (3,)
    expected = [await complete(engine, r, max_new_tokens=6) for r in rows]
    assert texts(out["text_output"]) == expected
    assert all(expected)
    # continuous batching: three rows of six tokens take far fewer than 3 x 6 engine steps
    assert batched_steps < 3 * 6


async def test_2d_prompts(engine):
    model = LlmTensorModel(engine, Limits())
    out = await model.infer(
        TensorRequest({"text_input": prompts("Hello", "Bye").reshape(2, 1)}, parameters={"max_new_tokens": 3})
    )
    assert texts(out["text_output"]) == [await complete(engine, p, max_new_tokens=3) for p in ("Hello", "Bye")]


@pytest.mark.parametrize("name", ["prompt", "inputs", "anything"])
async def test_an_undeclared_input_name_is_refused(engine, name):
    model = LlmTensorModel(engine, Limits(), name="llm")
    with pytest.raises(InvalidRequest) as info:
        await model.infer(TensorRequest({name: prompts("Hello")}, parameters={"max_new_tokens": 3}))
    assert info.value.message == f"unexpected inference input '{name}' for model 'llm'"


async def test_parameters_use_the_lmi_mapping(engine):
    model = LlmTensorModel(engine, Limits(default_max_new_tokens=4, max_new_tokens_limit=16))
    full = await model.infer(
        TensorRequest({"text_input": prompts("Hello")}, parameters={"return_full_text": True, "content_type": "str"})
    )
    assert texts(full["text_output"])[0] == "Hello" + await complete(engine, "Hello", max_new_tokens=4)
    with pytest.raises(InvalidRequest, match="max_new_tokens must be <= 16"):
        await model.infer(TensorRequest({"text_input": prompts("Hello")}, parameters={"max_new_tokens": 17}))
    with pytest.raises(InvalidRequest, match="temperature"):
        await model.infer(TensorRequest({"text_input": prompts("Hello")}, parameters={"temperature": -1}))


async def test_bad_tensors_are_invalid_requests(engine):
    model = LlmTensorModel(engine, Limits())
    with pytest.raises(InvalidRequest, match="UTF-8"):
        await model.infer(TensorRequest({"text_input": np.array([b"\xff\xfe"], dtype=object)}))
    with pytest.raises(InvalidRequest, match="must hold text"):
        await model.infer(TensorRequest({"text_input": np.array([1.0, 2.0])}))
    with pytest.raises(InvalidRequest, match=r"^unexpected inference inputs \['a','b'\] for model ''$"):
        await model.infer(TensorRequest({"a": prompts("x"), "b": prompts("y")}))
    with pytest.raises(InvalidRequest, match=r"^expected 1 inputs but got 0 inputs for model ''\. Got input\(s\) \[\]"):
        await model.infer(TensorRequest({}))
    with pytest.raises(InvalidRequest, match="empty prompt"):
        await model.infer(TensorRequest({"text_input": prompts("")}))
    with pytest.raises(InvalidRequest, match="unknown output 'nope'"):
        await model.infer(TensorRequest({"text_input": prompts("x")}, outputs=["nope"]))


async def test_a_failing_row_cancels_the_others(engine):
    model = LlmTensorModel(engine, Limits(default_max_new_tokens=200))
    too_long = "word " * 400  # beyond the tiny model's 256-token context
    with pytest.raises(InvalidRequest):
        await model.infer(TensorRequest({"text_input": prompts("Hello", too_long)}))
    for _ in range(500):  # the aborted row leaves the batch at the engine's next step
        if engine.num_running == 0 and engine.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.num_running == 0 and engine.num_waiting == 0


def service(name: str, model_id: str | None = None, **options) -> ModelService:
    return ModelService(Settings.from_options({"model_id": model_id, **options}), name=name)


def test_registry_resolves_names_and_defaults(tmp_path):
    emb = tmp_path / "emb"
    emb.mkdir()
    (emb / "modules.json").write_text("[]")
    llm, embedding = service("llm"), service("emb", str(emb))
    assert (llm.kind, embedding.kind) == ("llm", "embedding")
    registry = ModelRegistry([llm, embedding])
    assert registry.get("emb") is embedding
    assert registry.default() is llm and registry.default_llm() is llm
    with pytest.raises(ModelNotFound, match="Model or workflow not found: nope"):
        registry.get("nope")
    only_embedding = ModelRegistry([embedding])
    assert only_embedding.default() is embedding
    with pytest.raises(NoTextModel, match="needs an LLM"):  # a 404 in each text protocol
        only_embedding.default_llm()
    with pytest.raises(ValueError, match="already registered"):
        registry.add(service("llm"))
    two_llms = ModelRegistry([llm, service("other")])
    with pytest.raises(ModelRequired, match="Parameter model_name is required."):
        two_llms.default()


async def test_registry_remove_and_tensor_model_before_load():
    registry = ModelRegistry([service("a"), service("b")])
    with pytest.raises(ModelNotReady):
        _ = registry.get("a").tensor_model
    removed = await registry.remove("a")
    assert removed.name == "a" and "a" not in registry and len(registry) == 1
    with pytest.raises(ModelNotFound):
        await registry.remove("a")


async def test_service_loads_the_llm_and_exposes_its_tensor_model(tiny_model_dir):
    svc = service("tiny", str(tiny_model_dir), max_new_tokens=3)
    await svc.load()
    try:
        assert svc.status == ModelService.READY, svc.error
        model = svc.tensor_model
        assert model.kind == "llm" and [t.name for t in model.signature.outputs] == ["text_output"]
        out = await model.infer(TensorRequest({"text_input": prompts("Hello")}))
        assert out["text_output"].shape == (1,)
    finally:
        await svc.close()


async def removed_while_loading(tiny_model_dir, **options) -> ModelService:
    """The service of the tiny model, removed from its registry while it loads (its load awaited)."""
    registry = ModelRegistry([service("tiny", str(tiny_model_dir), **options)])
    svc = registry.get("tiny")
    loading = asyncio.ensure_future(svc.load())
    await asyncio.sleep(0)
    await registry.remove("tiny")
    await loading
    assert svc.status == ModelService.FAILED and svc.error == "unloaded while loading"
    return svc


async def test_a_model_removed_while_loading_never_starts(tiny_model_dir):
    svc = await removed_while_loading(tiny_model_dir)
    assert svc.engine is None or svc.engine._task is None


async def test_a_model_removed_while_its_engine_process_starts_leaves_no_process(tiny_model_dir):
    svc = await removed_while_loading(tiny_model_dir, engine_process="true", grpc_port="0")
    assert svc.engine is not None and not svc.engine.process.is_alive()


def test_an_adapter_that_is_not_served_is_not_found():
    """KServe V2 infer, TF Serving, Vertex and SageMaker on an LLM: `adapter_id` selects a LoRA adapter;
    one that is not served is refused (404), never answered by the base model."""
    model = LlmTensorModel(engine=None, limits=Limits(), name="tiny")  # type: ignore[arg-type]
    with pytest.raises(AdapterNotFound, match="`adapter_id` names adapter `my-lora`, which is not served"):
        model.adapter({"adapter_id": "my-lora"})
    assert model.adapter({"adapter_id": "tiny"}) is None  # the base model itself
    assert model.adapter({"adapter_id": None}) is None
    assert model.sampling({"adapter_id": "my-lora"})[0].max_new_tokens == 30  # not a sampling parameter


async def test_engine_process_on_a_one_shot_model_is_said_not_dropped(torchscript_dir, caplog):
    """`engine_process` is the LLM engine's: a one-shot model served with it runs in the server's process,
    and the log says so."""
    svc = service("affine", str(torchscript_dir), engine_process="true")
    with caplog.at_level("WARNING", logger="lmiserve.models.service"):
        await svc.load()
    try:
        assert svc.status == ModelService.READY, svc.error
        assert (
            "engine_process applies to LLMs: the torchscript model affine runs in the server's process" in caplog.text
        )
    finally:
        await svc.close()


def test_engine_process_unset_is_on_for_an_llm_on_a_gpu_and_off_on_the_cpu(monkeypatch, caplog):
    """`engine_process` unset: the engine in its own process where the model serves on a GPU (measured there:
    benchmarks/README.md), in the server's on the CPU; set, as set."""
    import torch

    from lmiserve.models.service import engine_process_wanted

    assert not engine_process_wanted(Settings())  # this machine: no GPU
    assert engine_process_wanted(Settings(engine_process="true"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level("INFO", logger="lmiserve.models.service"):
        assert engine_process_wanted(Settings())
    assert "engine_process unset: on for a GPU" in caplog.text
    assert not engine_process_wanted(Settings(engine_process="false"))
    assert not engine_process_wanted(Settings(device="cpu"))
