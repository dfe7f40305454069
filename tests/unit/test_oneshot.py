"""Dynamic batching of one-shot models: concurrent requests share one forward pass, results equal the
unbatched ones, a bad request fails alone, the queue is bounded, cancelled requests leave it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from helpers.tensor_models import affine_reference
from helpers.waiting import async_wait_until
from lmiserve.config import Settings
from lmiserve.core.errors import GenerationFailed, InvalidRequest, ModelNotReady, Overloaded
from lmiserve.core.tensors import ModelSignature, TensorRequest, TensorSpec
from lmiserve.models.service import ModelService
from lmiserve.models.store import model_settings
from lmiserve.oneshot.batcher import BatchConfig, OneShotModel


class DoublingRunner:
    """x -> 2x; a row holding -1 makes the whole forward fail (a poisoned batch); records batch sizes."""

    kind = "torchscript"
    signature = ModelSignature((TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),))

    def __init__(self, gate: threading.Event | None = None):
        self.batches: list[int] = []
        self.gate = gate

    def prepare(self, request: TensorRequest) -> dict[str, np.ndarray]:
        x = np.asarray(request.inputs["x"], dtype=np.float32)
        if x.ndim != 2:
            raise InvalidRequest("x must be 2-D")
        return {"x": x}

    def forward(self, inputs):
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append(inputs["x"].shape[0])
        if (inputs["x"] == -1).any():
            raise RuntimeError("poisoned row")
        return {"y": inputs["x"] * 2}


def request(*rows) -> TensorRequest:
    return TensorRequest({"x": np.array(rows, dtype=np.float32).reshape(-1, 2)})


@pytest.fixture
async def make():
    models = []

    def build(runner, **config) -> OneShotModel:
        model = OneShotModel(runner, BatchConfig(**config), "m")
        model.start()
        models.append(model)
        return model

    yield build
    for model in models:
        await model.stop()


async def test_concurrent_requests_share_one_forward(make):
    runner = DoublingRunner()
    model = make(runner, batch_size=6, max_batch_delay=60.0)  # runs as soon as 6 rows are there
    requests = [request([i, i + 0.5]) for i in range(4)] + [request([10, 11], [12, 13])]
    results = await asyncio.gather(*(model.infer(r) for r in requests))
    assert runner.batches == [6]
    assert model.forwards == 1
    for req, out in zip(requests, results):
        np.testing.assert_array_equal(out["y"], req.inputs["x"] * 2)


async def test_batches_never_exceed_batch_size_and_a_large_request_runs_alone(make):
    runner = DoublingRunner()
    model = make(runner, batch_size=4, max_batch_delay=0.05)
    big = request(*[[i, i] for i in range(6)])
    results = await asyncio.gather(
        *(model.infer(r) for r in [request([1, 1]), big, request([2, 2]), request([3, 3], [4, 4])])
    )
    assert sorted(runner.batches) == [4, 6] and model.forwards == 2
    np.testing.assert_array_equal(results[1]["y"], big.inputs["x"] * 2)


async def test_different_layouts_do_not_batch_together(make):
    runner = DoublingRunner()
    runner.signature = ModelSignature((TensorSpec("x", "FP32", (-1, -1)),), runner.signature.outputs)
    model = make(runner, batch_size=8, max_batch_delay=0.05)
    a, b = request([1, 2]), TensorRequest({"x": np.ones((1, 3), np.float32)})
    _out_a, out_b = await asyncio.gather(model.infer(a), model.infer(b))
    assert runner.batches == [1, 1]
    assert out_b["y"].shape == (1, 3)


async def test_a_bad_request_fails_only_itself(make):
    runner = DoublingRunner()
    model = make(runner, batch_size=8, max_batch_delay=5.0)
    good1, bad, good2 = request([1, 2]), request([-1, 0]), request([3, 4])
    results = await asyncio.gather(
        *(
            model.infer(r)
            for r in (
                good1,
                bad,
                good2,
                request([5, 6]),
                request([7, 8]),
                request([9, 9]),
                request([1, 1]),
                request([2, 2]),
            )
        ),
        return_exceptions=True,
    )
    assert isinstance(results[1], GenerationFailed) and "poisoned row" in results[1].message
    np.testing.assert_array_equal(results[0]["y"], [[2, 4]])
    np.testing.assert_array_equal(results[2]["y"], [[6, 8]])
    assert sum(isinstance(r, Exception) for r in results) == 1
    assert runner.batches[0] == 8 and runner.batches[1:] == [1] * 8  # the batch, then one by one
    with pytest.raises(InvalidRequest, match="2-D"):  # invalid before queueing
        await model.infer(TensorRequest({"x": np.zeros(2, np.float32)}))
    out = await model.infer(request(*[[0, 1]] * 8))  # the loop survived (8 rows: no wait for more)
    np.testing.assert_array_equal(out["y"], [[0, 2]] * 8)


async def test_full_queue_is_overloaded_and_cancelled_requests_leave_it(make):
    gate = threading.Event()
    runner = DoublingRunner(gate)
    model = make(runner, batch_size=1, max_batch_delay=0.0, job_queue_size=2)
    running = asyncio.ensure_future(model.infer(request([1, 1])))
    await async_wait_until(
        lambda: model.forwards == 1, "the first request is in the forward pass (blocked on the gate)"
    )
    waiting = [asyncio.ensure_future(model.infer(request([i, i]))) for i in (2, 3)]
    await async_wait_until(lambda: model.num_waiting == 2, "both requests are queued")
    assert model.num_waiting == 2
    with pytest.raises(Overloaded):
        await model.infer(request([4, 4]))
    waiting[0].cancel()
    await async_wait_until(lambda: waiting[0].done(), "the cancelled request has ended")
    assert model.num_waiting == 1
    gate.set()
    assert (await running)["y"].tolist() == [[2, 2]]
    assert (await waiting[1])["y"].tolist() == [[6, 6]]
    assert runner.batches == [1, 1]  # the cancelled request never ran


async def test_stop_fails_queued_requests():
    gate = threading.Event()
    model = OneShotModel(DoublingRunner(gate), BatchConfig(batch_size=1), "m")
    with pytest.raises(ModelNotReady):
        await model.infer(request([1, 1]))
    model.start()
    first = asyncio.ensure_future(model.infer(request([1, 1])))
    await async_wait_until(
        lambda: model.forwards == 1, "the first request is in the forward pass (blocked on the gate)"
    )
    queued = asyncio.ensure_future(model.infer(request([2, 2])))
    await async_wait_until(lambda: model.num_waiting == 1, "the second request is queued")
    await model.stop()
    gate.set()
    with pytest.raises(ModelNotReady, match="unloaded"):
        await queued
    first.cancel()


async def test_real_torchscript_batched_equals_unbatched(torchscript_dir):
    # max_batch_delay 10 min: the batch runs when its 16 rows are there, never because time passed
    settings = model_settings(Settings(), torchscript_dir, "affine", {"batch_size": 16, "max_batch_delay": 600_000})
    service = ModelService(settings)
    await service.load()
    try:
        model = service.tensor_model
        xs = [np.random.default_rng(i).normal(size=(i % 3 + 1, 4)).astype(np.float32) for i in range(6)]  # 12 rows
        pending = [asyncio.ensure_future(model.infer(TensorRequest({"x": x}))) for x in xs]
        await async_wait_until(lambda: model.num_waiting == len(xs), "the 12 rows are queued")
        assert model.forwards == 0  # waiting for 16 rows
        more = np.ones((4, 4), np.float32)
        results = await asyncio.gather(*pending, model.infer(TensorRequest({"x": more})))
        assert model.forwards == 1  # 16 rows: one forward pass
        for x, out in zip([*xs, more], results):
            y, best = affine_reference(x)
            np.testing.assert_allclose(out["y"], y, rtol=1e-5, atol=1e-6)
            assert out["best"].tolist() == best.tolist()
    finally:
        await service.close()
