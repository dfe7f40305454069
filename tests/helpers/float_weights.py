"""A loaded model's weights as floats, whatever layers hold them: a layer of codes (`codes_linear.CodesLinear`: AWQ/GPTQ
codes, int8 codes, fp8 weights kept fp8 on a CPU or a GPU) de-quantized, for tests that compare a quantized checkpoint's
model with the float model it encodes."""

from __future__ import annotations

import torch

from lmiserve.engine.model.codes_linear import CodesLinear


def weight_of(module: torch.nn.Module) -> torch.Tensor:
    """The float weight (fp32) a linear's product uses: a layer of codes de-quantized."""
    if isinstance(module, CodesLinear):
        return module.dequantized().float()  # type: ignore[operator]
    return module.weight.detach().float()  # type: ignore[union-attr]


def float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict with each layer of codes as the ``weight`` (and ``bias``) of the float linear it stands for."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, CodesLinear):
            prefix = f"{name}." if name else ""
            state[f"{prefix}weight"] = weight_of(module)
            if module.bias is not None:
                state[f"{prefix}bias"] = module.bias.detach().float()
    return state
