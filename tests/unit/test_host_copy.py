"""engine/host_copy.py: a step's host values on its device, copied without the host waiting (pinned on CUDA;
benchmarks/gpu_check.py runs this on the GPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lmiserve.engine import host_copy

DEVICE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu"))


@pytest.mark.parametrize(
    "values,want",
    [
        ([3, 1, 2], torch.tensor([3, 1, 2])),
        ([[1, 2], [5, 6]], torch.tensor([[1, 2], [5, 6]])),
        ([], torch.zeros(0, dtype=torch.int64)),  # a step that keeps no row's logits
        (np.array([7, 8], dtype=np.int32), torch.tensor([7, 8], dtype=torch.int32)),
        (torch.tensor([9, 4]), torch.tensor([9, 4])),
    ],
    ids=["list", "rows", "empty", "numpy", "tensor"],
)
def test_values_arrive_on_the_device_with_their_dtype(values, want):
    got = host_copy.to_device(values, DEVICE)
    assert got.device.type == DEVICE.type and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


def test_rows_of_one_copy_unpack_as_the_steps_ids_and_positions():
    ids, positions = host_copy.to_device([[11, 12, 13], [0, 1, 2]], DEVICE)
    assert ids.tolist() == [11, 12, 13] and positions.tolist() == [0, 1, 2]
    assert ids.is_contiguous() and positions.is_contiguous()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="pinned memory and asynchronous copies are CUDA's")
def test_on_cuda_the_copy_comes_from_pinned_memory_without_a_wait(monkeypatch):
    """The copy is queued behind work already on the stream (a long product here) and does not wait for it:
    the host gets its tensor back before the product is done, and the stream still orders them."""
    seen = []
    pin = torch.Tensor.pin_memory

    def pinning(self, *args, **kwargs):  # noqa: ANN001, ANN202 - Tensor.pin_memory's
        seen.append(self.shape)
        return pin(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pinning)
    host_copy.to_device(np.arange(4), DEVICE)
    assert seen == [torch.Size([4])]
    host_copy.to_device(list(range(1000)), DEVICE)  # the pinned block of this size allocated (that may wait)
    big = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    for _ in range(20):
        big = big @ big / 64
    done.record()
    got = host_copy.to_device(list(range(1000)), DEVICE)
    assert not done.query()  # the host did not wait for the products queued before the copy
    assert got.sum().item() == sum(range(1000))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="pinning is refused on a machine without a GPU")
def test_where_pinning_is_refused_the_values_stay_pageable_and_it_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(host_copy, "_pinning", True)
    with caplog.at_level("WARNING", logger="lmiserve.engine.host_copy"):
        first = host_copy.host_tensor([1, 2, 3], pin=True)
        second = host_copy.host_tensor(np.array([4, 5]), pin=True)
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]
    assert not first.is_pinned() and not host_copy._pinning
    assert [r.message.startswith("pinned host memory is refused here") for r in caplog.records] == [True]
