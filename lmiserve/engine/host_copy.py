"""A step's host values copied to its device without making the host wait (issue #39).

``torch.tensor(values, device=cuda)`` (and ``.to(cuda)`` without ``non_blocking``) synchronizes the stream
after its copy: the host waits for everything the GPU has queued, with overlap scheduling the whole step
before, before it launches the next kernel. A ``non_blocking`` copy from ordinary (pageable) host memory
may still synchronize, as the CUDA driver stages it (CUDA's "API synchronization behavior"). So on CUDA a
step's ids, positions, tables, kept rows and attention tiles are made in pinned memory (torch's caching host allocator
reuses its blocks, and holds each until its copy is done) and copied without waiting, as vLLM and SGLang
copy their inputs. On a CPU the values are the tensor. `tests/unit/test_capture_hazards.py` checks that an
eager step's forward makes no copy the host waits for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_device"]


def to_device(values: Any, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (nested lists of numbers of `dtype`, a numpy array or a CPU tensor) as a tensor on `device`,
    copied without the host waiting for the device."""
    cuda = device.type == "cuda"
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if isinstance(values, torch.Tensor):
        host = values.pin_memory() if cuda else values
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=cuda)
    return host.to(device, non_blocking=True)  # (on a CPU: `host` itself)
