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
    channel); the lm_head and a mixture of experts' routers left float (``ignore``), as published W4A16
    checkpoints leave them. A mixture of experts' experts (transformers' merged tensors, not linears the scheme
    targets) are each expert's matrices as transformers saves them, each compressed by the package's compressor
    with the scheme (`_compress_experts`), as llm-compressor publishes Qwen3-MoE's W4A16."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    args = _args(fmt, group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    ignore = ["lm_head", "re:.*mlp.gate$"]
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
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
    _compress_experts(folder, scheme, group)
    return folder


def _compress_experts(folder: Path, scheme: Any, group: int) -> None:
    """Each expert's saved float matrices (``...experts.<e>.<name>_proj.weight``) replaced by the package's
    compression of them."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    for file in sorted(folder.glob("*.safetensors")):
        state = load_file(str(file))
        names = [n for n, t in state.items() if ".experts." in n and n.endswith("_proj.weight") and t.dim() == 2]
        for name in names:
            weight = state.pop(name).float()
            ranges = weight.view(weight.shape[0], -1, group) if group > 0 else weight[:, None, :]
            scale, zero = calculate_qparams(ranges.amin(-1), ranges.amax(-1), scheme.weights)
            parts = {"weight": weight, "weight_scale": scale.to(torch.bfloat16).float(), "weight_zero_point": zero}
            packed = PackedQuantizationCompressor.compress(parts, scheme)
            state.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
        if names:
            save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})


def decompressed(fmt: str, group: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight compressed-tensors' own compressor reads from one linear's stored `tensors` (``weight_packed``,
    ``weight_scale``, ``weight_shape``, ``weight_zero_point``) of a `write_w4a16` checkpoint of `fmt` and `group`."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=_args(fmt, group))
    weight: torch.Tensor = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    return weight.float()
