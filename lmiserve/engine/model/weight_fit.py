"""Whether a quantized checkpoint's weights stay quantized on a GPU where their kernel is not yet measured there, or
are de-quantized at load (issue #39): AWQ/GPTQ's 4-bit codes on `int4_triton`'s kernel, fp8 weights on a GPU without
fp8 products (compute capability below 8.9: A100, A10G) on `fp8_gemv`'s widening kernel.

De-quantized weights run the products every GPU has (bf16 GEMMs, measured); quantized ones take a half (fp8) or a
quarter (4-bit) of their memory. So the weights stay quantized where de-quantized they would take more than
`FIT_SHARE` of the GPU's free memory (the rest is the KV cache's: a 70B AWQ model on one 80 GB GPU, an 8B fp8 model
on a 24 GB A10G), or where the kernel's switch in the environment forces it (``1``; ``0`` always de-quantizes)."""

from __future__ import annotations

import importlib.util
import logging

import torch

__all__ = ["FIT_SHARE", "kept", "kept_for", "triton_gpu"]

FIT_SHARE = 0.5  # de-quantized weights over this share of the GPU's free memory: they stay quantized


def triton_gpu(device: torch.device) -> bool:
    """Whether `device` is a GPU where the Triton kernels that keep quantized weights run: CUDA, Triton installed,
    compute capability 8.0 or more."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def kept(forced: bool | None, dequantized_bytes: int, free_bytes: int) -> bool:
    """Whether the weights stay quantized: as `forced` says (a switch's value), else where de-quantized to the
    compute dtype (`dequantized_bytes`) they would take more than `FIT_SHARE` of the GPU's `free_bytes`."""
    if forced is not None:
        return forced
    return dequantized_bytes > FIT_SHARE * free_bytes


def kept_for(
    log: logging.Logger,
    model: torch.nn.Module,
    device: torch.device,
    name: str,
    forced: bool | None,
    switch: str,
    kept_as: str,
) -> bool:
    """`kept` for the linears of `model` on the CUDA `device` (on the meta device with its linears in the compute
    dtype, or on the GPU already: a whole model's, or a tensor-parallel rank's shell): every parameter's bytes
    against the GPU's free memory; logged (by `log`) for the checkpoint `name` with its reason (`kept_as`: what
    kept weights run on; `switch`: the variable that forced it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    free = torch.cuda.mem_get_info(device)[0]
    keep = kept(forced, total, free)
    dtype = next((str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()), "?")
    how = f"forced by {switch}" if forced is not None else (
        f"{total / 1e9:.1f} GB de-quantized to {dtype}, {free / 1e9:.1f} GB free on the GPU: the weights stay "
        f"quantized where that is over {FIT_SHARE:.0%}"
    )  # fmt: skip
    log.info("%s: %s (%s)", name, kept_as if keep else "de-quantized at load", how)
    return keep
