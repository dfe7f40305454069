"""A step's host values copied to its device without making the host wait (issue #39).

``torch.tensor(values, device=cuda)`` (and ``.to(cuda)`` without ``non_blocking``) synchronizes the stream
after its copy: the host waits for everything the GPU has queued, with overlap scheduling the whole step
before, before it launches the next kernel. A ``non_blocking`` copy from ordinary (pageable) host memory
may still synchronize, as the CUDA driver stages it (CUDA's "API synchronization behavior"). So on CUDA a
step's ids, positions, tables, kept rows and attention tiles are made in pinned memory (torch's caching
host allocator reuses its blocks, and holds each until its copy is done) and copied without waiting, as
vLLM and SGLang copy their inputs; where pinning is refused (vLLM meets that under WSL), they are copied
from pageable memory, still without waiting. On a CPU the values are the tensor.
`tests/unit/test_capture_hazards.py` checks that an eager step's forward makes no copy the host waits for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["host_tensor", "row_pairs", "row_values", "to_device"]

log = logging.getLogger(__name__)

_pinning = True  # False once pinning was refused here (WSL, a container's limits): pageable copies then


def host_tensor(values: Any, dtype: torch.dtype = torch.int64, pin: bool = False) -> torch.Tensor:
    """`values` (nested lists of numbers of `dtype`, a numpy array or a CPU tensor) as a host tensor, in
    pinned memory where `pin` asks and pinning works here (the first refusal is logged, then pageable)."""
    global _pinning
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if not (pin and _pinning):
        return tensor
    try:
        return tensor.pin_memory()
    except RuntimeError as exc:
        _pinning = False
        log.warning("pinned host memory is refused here (%s): a step's inputs are copied from pageable memory", exc)
        return tensor


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (as `host_tensor` takes them) as a tensor on `device`, copied without the host waiting for
    the device (on a CPU: the host tensor itself)."""
    return host_tensor(values, dtype, pin=device.type == "cuda").to(device, non_blocking=True)


def row_pairs(per_row: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token) pairs of each row's tokens (a logit bias's, a penalty's) as two index tensors on
    `device`, rows numbered from 0: one indexed op reaches every row's tokens."""
    at = [j for j, ids in enumerate(per_row) for _ in ids]
    return to_device(at, device), to_device([t for ids in per_row for t in ids], device)


def row_values(per_row: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    """Each row's values flattened, in `like`'s dtype on its device (one value a pair of `row_pairs`)."""
    return to_device([v for vs in per_row for v in vs], like.device, like.dtype)
