"""compressed-tensors' integer checkpoints (``pack-quantized``: llm-compressor's W4A16, W4A16_ASYM and W8A16;
``int-quantized``: W8A8) written by the compressed-tensors package itself, as llm-compressor saves them: the scheme applied to the model
(`apply_quantization_config`), each linear's scales and zero points set from its weights' ranges by the package's
`calculate_qparams` (min-max: what llm-compressor's observer gives before GPTQ's updates), then the package's
compressor packs the model (`ModelCompressor.compress_model`), transformers saves it and the compressor writes the
``quantization_config``. The reference de-quantization is the package's own (`decompressed`).

Scales are rounded to bf16 values, as a published checkpoint's are (they are stored in the model's dtype)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

INT4_FORMATS = ("w4a16", "w4a16-asym")  # symmetric (GPTQ's default) or with zero points (AWQ's)
FORMATS = (
    *INT4_FORMATS,
    "w8a8",
    "w8a16",
    "w8a16-asym",
)  # W8A8: int8 by channel, int8 activations by token; W8A16: packed


def _scheme(fmt: str, group: int) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "group" if group > 0 and fmt != "w8a8" else "channel"
    weights = QuantizationArgs(
        num_bits=8 if fmt.startswith("w8") else 4,
        type="int",
        strategy=strategy,
        group_size=group if strategy == "group" else None,
        symmetric=not fmt.endswith("-asym"),
    )
    activations = (
        QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
        if fmt == "w8a8"
        else None
    )
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)


def _format(fmt: str) -> str:
    return "int-quantized" if fmt == "w8a8" else "pack-quantized"


def _compressor(fmt: str) -> Any:
    from compressed_tensors.compressors.naive_quantized import IntQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor

    return IntQuantizationCompressor if fmt == "w8a8" else PackedQuantizationCompressor


def write_compressed(model: torch.nn.Module, folder: Path, fmt: str, group: int) -> Path:
    """A copy of `model` in `folder` as a `fmt` checkpoint (`FORMATS`) by groups of `group` inputs (0: by output
    channel; W8A8 is by channel); the lm_head and a mixture of experts' routers left float (``ignore``), as
    published checkpoints leave them. A mixture of experts' experts (transformers' merged tensors, not linears the scheme
    targets) are each expert's matrices as transformers saves them, each compressed by the package's compressor
    with the scheme (`_compress_experts`), as llm-compressor publishes Qwen3-MoE's W4A16."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    scheme = _scheme(fmt, group)
    args, group = scheme.weights, group if fmt != "w8a8" else 0
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
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=_format(fmt))
    compressor.compress_model(model)
    model.save_pretrained(folder)  # type: ignore[operator]
    compressor.update_config(str(folder))
    _compress_experts(folder, fmt, scheme, group)
    return folder


def _compress_experts(folder: Path, fmt: str, scheme: Any, group: int) -> None:
    """Each expert's saved float matrices (``...experts.<e>.<name>_proj.weight``) replaced by the package's
    compression of them."""
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
            packed = _compressor(fmt).compress(parts, scheme)
            state.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
        if names:
            save_file({k: v.contiguous() for k, v in state.items()}, str(file), metadata={"format": "pt"})


def decompressed(fmt: str, group: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight compressed-tensors' own compressor reads from one linear's stored `tensors` (``weight_packed``,
    ``weight_scale``, ``weight_shape``, ``weight_zero_point``; W8A8's ``weight``) of a `write_compressed` checkpoint
    of `fmt` and `group`."""
    weight: torch.Tensor = _compressor(fmt).decompress(dict(tensors), _scheme(fmt, group))["weight"]
    return weight.float()
