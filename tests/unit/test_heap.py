"""core/heap.py: a loaded model's heap is frozen out of the collector's way, and thawed when it is unloaded."""

from __future__ import annotations

import gc

from lmiserve.config import Settings
from lmiserve.core import heap
from lmiserve.models.service import ModelService


def test_freeze_moves_what_is_alive_out_of_the_collectors_way_and_thaw_gives_it_back():
    kept = [[i] for i in range(1000)]  # container objects: tracked by the collector
    try:
        assert heap.freeze() >= len(kept)
        assert gc.get_freeze_count() >= len(kept)
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0


async def test_a_loaded_model_is_frozen_and_its_unloading_thaws_the_heap(tiny_model_dir):
    service = ModelService(Settings.from_options({"model_id": str(tiny_model_dir)}), name="tiny")
    await service.load()
    try:
        assert service.status == ModelService.READY, service.error
        assert gc.get_freeze_count() > 10_000  # torch, transformers, the model: out of every collection
    finally:
        await service.close()
    assert gc.get_freeze_count() == 0
