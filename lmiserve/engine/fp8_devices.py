"""Which devices convert fp8 themselves (issue #39): CUDA GPUs of compute capability 8.9 or more (Ada, Hopper) have
fp8 products (``torch._scaled_mm``) and Triton's ``float8e4nv`` type; an A100 or A10G (8.0-8.6) has neither, so the
fp8 Triton kernels (the fp8 weights' `engine/model/fp8_gemv.py`, an fp8 KV cache's `engine/attention/triton_ops.py`)
widen the bytes themselves there (`engine/model/fp8_gemv_kernel.py`'s doc)."""

from __future__ import annotations

import torch

__all__ = ["native"]

_native: dict[torch.device, bool] = {}


def native(device: torch.device) -> bool:
    """Whether `device` multiplies and converts fp8 itself: CUDA with compute capability 8.9 or more, and a CPU
    (torch's CPU ``_scaled_mm``, the interpreter's fp8 types; the tests replace this function to run the kernels
    as an A100 does)."""
    if device.type != "cuda":
        return True
    if device not in _native:
        _native[device] = torch.cuda.get_device_capability(device) >= (8, 9)
    return _native[device]
