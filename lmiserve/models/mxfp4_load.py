"""gpt-oss's MXFP4 checkpoints (``quant_method: mxfp4``: the experts' weights as 4-bit floats, a power of two a block
of 32 inputs; everything else as saved): on a GPU where the model de-quantized would not fit (`mxfp4_experts.kept_for`)
its experts stay MXFP4 on the grouped Triton kernel, on a CPU (fp32 or bf16) on its f4 kernel
(`load_kept`); elsewhere transformers de-quantizes them at load (`load_dequantized`, exactly: every such value
is a bf16 value), as vLLM does where it has no MXFP4 kernel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmiserve.engine.model import mxfp4_experts
from lmiserve.engine.model.cpu_experts import kernel_named
from lmiserve.models.attention_choice import sdpa_or_default
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.int4_load import SafetensorsFiles, meta_tensors

__all__ = ["load_dequantized", "load_kept"]


def load_kept(model: Any, path: Path, stored: dict[str, Path], device: torch.device) -> tuple[Any, str]:
    """`model` (gpt-oss on the meta device, `quantized_load.meta_model`) filled from the checkpoint `path` (`stored`:
    its tensors' files): every experts module kept on `device` (`mxfp4_experts.keep_stored`), the rest read as
    stored, in the model's dtype but the modules transformers keeps in fp32 (gpt-oss's norms), as `load_dequantized`
    holds them."""
    for name, parameter in model.named_parameters():
        if parameter.is_floating_point() and _kept_fp32(model, name):
            parameter.data = parameter.data.float()
    with SafetensorsFiles(stored) as files:
        kept = mxfp4_experts.keep_stored(model, stored, files.slice, device)
        files.fill(model)
    left = [name for name, _ in meta_tensors(model)]
    if left:
        raise ModelLoadError(f"{path.name}: {', '.join(left[:5])} left without values")
    kernel = kernel_named([model.get_submodule(name) for name in kept])
    return model, f"mxfp4 checkpoint: {len(kept)} experts modules kept MXFP4 ({kernel})"


def load_dequantized(path: Path, dtype: torch.dtype, trust_remote_code: bool, auto_class: Any) -> tuple[Any, str]:
    """gpt-oss's MXFP4 experts dequantized to `dtype` by transformers at load (``Mxfp4Config``; no download; they take
    about 4x their bytes on disk). Exact: every value is the format's value times its block's scale."""
    from transformers import Mxfp4Config  # type: ignore[attr-defined]

    config = Mxfp4Config(dequantize=True)

    def make(**sdpa: Any) -> Any:
        common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
        return auto_class.from_pretrained(path, dtype=dtype, quantization_config=config, **common, **sdpa)

    model = sdpa_or_default(path, make)
    for name, parameter in model.named_parameters():  # (the fp8 quantizer leaves the rest in the stored dtype)
        if parameter.is_floating_point() and parameter.dtype != dtype and not _kept_fp32(model, name):
            parameter.data = parameter.data.to(dtype)
    kind = str(dtype).removeprefix("torch.")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return model, f"mxfp4 checkpoint: the experts' {experts / 1e9:.2f}B weights dequantized to {kind} at load"


def _kept_fp32(model: Any, name: str) -> bool:
    """Whether parameter `name` is in a module transformers keeps in fp32 (``_keep_in_fp32_modules``: gpt-oss's
    norms)."""
    return bool(set(getattr(model, "_keep_in_fp32_modules", None) or ()) & set(name.split(".")))
