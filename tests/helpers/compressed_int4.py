"""compressed-tensors' 4-bit checkpoints (``pack-quantized``: llm-compressor's W4A16 and W4A16_ASYM) written by the
compressed-tensors package itself, as llm-compressor saves them: the scheme applied to the model
(`apply_quantization_config`), each linear's scales and zero points set from its weights' ranges by the package's
`calculate_qparams` (min-max: what llm-compressor's observer gives before GPTQ's updates), then the package's
compressor packs the model (`ModelCompressor.compress_model`), transformers saves it and the compressor writes the
``quantization_config``. The reference de-quantization is the package's own (`decompressed`).

Scales are rounded to bf16 values, as a published checkpoint's are (they are stored in the model's dtype)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

FORMATS = ("w4a16", "w4a16-asym")  # symmetric (GPTQ's default) or with zero points (AWQ's)


def _args(fmt: str, group: int) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    strategy = "group" if group > 0 else "channel"
    return QuantizationArgs(
        num_bits=4, type="int", strategy=strategy, group_size=group if group > 0 else None, symmetric=fmt == "w4a16"
    )


def write_w4a16(model: torch.nn.Module, folder: Path, fmt: str, group: int) -> Path:
    """A copy of `model` in `folder` as a `fmt` checkpoint (`FORMATS`) by groups of `group` inputs (0: by output
    channel); the lm_head left float (``ignore``), as published W4A16 checkpoints leave it."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    args = _args(fmt, group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            module = cast(Any, module)  # (the scheme's parameters are set attributes)
            if not hasattr(module, "weight_scale"):
                continue
            weight = module.weight.detach().float()
            ranges = weight.view(weight.shape[0], -1, group) if group > 0 else weight[:, None, :]
            scale, zero = calculate_qparams(ranges.amin(-1), ranges.amax(-1), args)
            module.weight_scale.copy_(scale.to(torch.bfloat16).float().view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):  # (a symmetric scheme's are not stored)
                module.weight_zero_point.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)  # type: ignore[operator]
    compressor.update_config(str(folder))
    return folder


def decompressed(fmt: str, group: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight compressed-tensors' own compressor reads from one linear's stored `tensors` (``weight_packed``,
    ``weight_scale``, ``weight_shape``, ``weight_zero_point``) of a `write_w4a16` checkpoint of `fmt` and `group`."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=_args(fmt, group))
    weight: torch.Tensor = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    return weight.float()
