"""A GPU's memory as torch reports it, replaced for the pool plan's tests on a CPU (engine/pool_plan.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

GIB = 2**30


def fake_gpu_memory(monkeypatch: pytest.MonkeyPatch, total: int, allocated: int, others: int = 0) -> None:
    """A GPU of `total` bytes where this process has `allocated` bytes (and as much reserved) and other
    processes hold `others`."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: allocated)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - allocated - others, total))
