"""fp8 checkpoints written by NVIDIA's Model Optimizer itself (``nvidia-modelopt``: `mtq.quantize` with a calibration
pass, then `export_hf_checkpoint`, as NVIDIA makes its ``-FP8`` releases), on the CPU, from a model of the tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import torch

# the formats' names in `helpers.quantizable.write_checkpoint` -> ModelOpt's configs (their `quant_algo`)
FORMATS = {
    "modelopt-fp8": "FP8_DEFAULT_CFG",  # FP8: a scale a tensor, a static input_scale
    "modelopt-fp8-channel": "FP8_PER_CHANNEL_PER_TOKEN_CFG",  # FP8_PER_CHANNEL_PER_TOKEN: a scale a channel
    "modelopt-fp8-block": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",  # FP8_PB_WO: a scale a block of 128 x 128
}


def installed() -> bool:
    """Whether ModelOpt is here (the test extra brings it; the GPU check's kit does not: its scipy would not fit a
    device call)."""
    return importlib.util.find_spec("modelopt") is not None


def write_modelopt(
    model: torch.nn.Module,
    folder: Path,
    fmt: str,
    kv_cache: bool = False,
    calibration: list[torch.Tensor] | None = None,
) -> Path:
    """A copy of `model` quantized by ModelOpt's config of `fmt` (calibrated on the prompts `calibration`, token ids
    ``[1, n]`` each; default: random ones) and exported to `folder` (a ``quantization_config`` in ``config.json`` and
    ``hf_quant_config.json``); with `kv_cache`, its fp8 KV cache config too (``k_proj.k_scale``,
    ``v_proj.v_scale``)."""
    with warnings.catch_warnings():  # (ModelOpt warns of a transformers it was not tested with)
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

    model = copy.deepcopy(model)  # (`mtq.quantize` changes the model it is given)
    model.config.architectures = [type(model).__name__]  # (the export reads them)
    config: dict[str, Any] = copy.deepcopy(getattr(mtq, FORMATS[fmt]))
    if kv_cache:
        config["quant_cfg"] = [*config["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]]
    if calibration is None:
        generator = torch.Generator().manual_seed(0)
        calibration = [torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)]
    device = next(model.parameters()).device

    def calibrate(m: torch.nn.Module) -> None:
        for ids in calibration:
            m(ids.to(device))

    with torch.no_grad():
        mtq.quantize(model, config, calibrate)
        export_hf_checkpoint(model, dtype=next(model.parameters()).dtype, export_dir=folder)
    return folder


def legacy_copy(folder: Path, to: Path) -> Path:
    """`folder`'s checkpoint as ModelOpt wrote it before its ``quantization_config`` went into ``config.json``: the
    config in ``hf_quant_config.json`` alone."""
    to.mkdir(parents=True)
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    config = json.loads((to / "config.json").read_text())
    del config["quantization_config"]
    (to / "config.json").write_text(json.dumps(config))
    return to
