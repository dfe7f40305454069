"""Write a float model as a quantized checkpoint of the published formats (issue #39): what the tests
and `benchmarks/quantized_quality.py` load back. The quantization is plain round-to-nearest (RTN): no
calibration, no AWQ activation-aware scaling, no GPTQ error feedback; only the storage is the formats'.

- ``fp8-channel`` / ``fp8-tensor``: compressed-tensors ``float-quantized`` (``weight`` float8_e4m3fn,
  ``weight_scale`` fp32 ``[out, 1]`` or ``[1]``, ``scale = max|w| / 448``), as llm-compressor writes it.
- ``fbgemm-fp8``: transformers' FBGEMM fp8 (``weight_scale`` ``[out, 1]``).
  A mixture of experts in these three is saved as transformers publishes it, each expert's matrices quantized (as
  llm-compressor's Qwen3-MoE and Mixtral fp8 releases).
- ``fp8-block``: block-wise fp8 as Qwen's and DeepSeek's FP8 releases store it (``quant_method: fp8``,
  ``weight_block_size``; ``weight`` float8_e4m3fn, ``weight_scale_inv`` fp32 ``[out / b, in / b]``, ``scale = max|w|
  / 448`` a block), every projection saved as transformers publishes it (a mixture of experts' experts one matrix
  each) quantized: `group` is the block's side.
- ``awq``: AutoAWQ's GEMM packing (`quant_formats.AWQ_ORDER`), asymmetric 4-bit per group over the
  group's own minimum and maximum (AutoAWQ's RTN rule).
- ``gptq``: AutoGPTQ's v1 packing (zeros stored minus one), asymmetric over a range that reaches 0
  (GPTQ's quantizer, without its error feedback), ``desc_act`` false; with
  `act_order` a permuted ``g_idx`` (groups of inputs that are not consecutive, as ``desc_act`` makes).

The output projection (and embeddings, norms) stay float, as the tools leave them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from lmiserve.engine.model.int4_triton import pack_nibbles
from lmiserve.engine.model.quant_formats import AWQ_ORDER, quantize_fp8

__all__ = ["FORMATS", "fp8_block_tensors", "rtn_int4", "write_quantized"]

FORMATS = ("fp8-channel", "fp8-tensor", "fbgemm-fp8", "fp8-block", "awq", "gptq", "gptq-int8")


def rtn_int4(
    weight: torch.Tensor, g_idx: torch.Tensor, groups: int, min_zero: int = 0, include_zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit RTN of ``[out, in]`` over the groups `g_idx` names: ``(codes int32 [out, in],
    scale fp16 [out, groups], zero int32 [out, groups])`` with ``w ~ (code - zero) * scale``; zeros at
    least `min_zero` (1 for GPTQ v1, which stores ``zero - 1``). `include_zero`: each group's range
    reaches 0 (GPTQ's quantizer does so; AutoAWQ's RTN takes the group's own minimum and maximum)."""
    w = weight.detach().float()
    out = w.shape[0]
    g_idx = g_idx.to(w.device)
    high = torch.full((out, groups), -torch.inf, device=w.device).scatter_reduce(1, g_idx.expand(out, -1), w, "amax")
    low = torch.full((out, groups), torch.inf, device=w.device).scatter_reduce(1, g_idx.expand(out, -1), w, "amin")
    if include_zero:
        low, high = low.clamp(max=0), high.clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-6).half()
    zero = torch.round(-low / scale.float()).clamp(min_zero, 15).to(torch.int32)
    codes = torch.round(w / scale.float()[:, g_idx]) + zero[:, g_idx]
    return codes.clamp(0, 15).to(torch.int32), scale, zero


def _awq_tensors(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    inputs = weight.shape[1]
    codes, scale, zero = rtn_int4(weight, torch.arange(inputs) // group, inputs // group, include_zero=False)
    order = list(AWQ_ORDER)
    qweight = pack_nibbles(codes.t().reshape(inputs, -1, 8)[..., order])  # [in, out / 8]
    qzeros = pack_nibbles(zero.t().reshape(zero.shape[1], -1, 8)[..., order])  # [groups, out / 8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous()}


def _gptq_tensors(weight: torch.Tensor, group: int, act_order: bool) -> dict[str, torch.Tensor]:
    inputs = weight.shape[1]
    g_idx = torch.arange(inputs) // group
    if act_order:  # groups of inputs taken in another order (what desc_act stores)
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))]
    codes, scale, zero = rtn_int4(weight, g_idx, inputs // group, min_zero=1)
    qweight = pack_nibbles(codes.t().reshape(inputs // 8, 8, -1).permute(0, 2, 1))  # [in / 8, out]
    qzeros = pack_nibbles((zero.t() - 1).reshape(zero.shape[1], -1, 8))  # [groups, out / 8], v1: zero - 1
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _gptq_int8_tensors(weight: torch.Tensor, group: int, act_order: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ's symmetric 8-bit codes by groups of `group` inputs (``sym: true``, as Qwen publishes its GPTQ-Int8
    models): a group's scale its largest magnitude over 127 (codes 1..255), its zero 128 (stored minus one, v1),
    four codes a word (code k at bits 8k), by inputs in ``qweight`` and by outputs in ``qzeros``; with `act_order` a
    permuted ``g_idx``, as the 4-bit codes'."""
    w = weight.detach().float()
    out, inputs = w.shape
    g_idx = torch.arange(inputs) // group
    if act_order:
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))]
    largest = torch.zeros(out, inputs // group).scatter_reduce(1, g_idx.expand(out, -1), w.abs(), "amax")
    scale = (largest / 127).clamp(min=1e-6).half()  # [out, groups]
    codes = (torch.round(w / scale.float()[:, g_idx]) + 128).clamp(0, 255).long()
    qweight = pack_nibbles(codes.t().reshape(inputs // 4, 4, out).permute(0, 2, 1), bits=8)  # [in / 4, out]
    qzeros = pack_nibbles(torch.full((scale.shape[1], out // 4, 4), 127), bits=8)  # [groups, out / 4]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _tensors_of(weight: torch.Tensor, fmt: str, group: int, act_order: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a `fmt` checkpoint stores for `weight` (by their short names), by groups (blocks) of `group`."""
    if fmt == "fp8-block":
        return fp8_block_tensors(weight, group)
    if fmt.startswith("fp8") or fmt == "fbgemm-fp8":
        return _fp8_tensors(weight, fmt == "fp8-tensor")
    if fmt == "awq":
        return _awq_tensors(weight, group)
    if fmt == "gptq-int8":
        return _gptq_int8_tensors(weight, group, act_order)
    return _gptq_tensors(weight, group, act_order)


def _fp8_tensors(weight: torch.Tensor, per_tensor: bool) -> dict[str, torch.Tensor]:
    w = weight.detach().float()
    if per_tensor:
        scale = (w.abs().max() / 448.0).clamp(min=1e-12).reshape(1)
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}
    q, channel = quantize_fp8(w)
    return {"weight": q, "weight_scale": channel[:, None].contiguous()}


def fp8_block_tensors(weight: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """Block-wise fp8 of a float `weight` as Qwen3's FP8 releases store it: ``weight`` and ``weight_scale_inv``
    (each `block` x `block` block's ``max|w| / 448``)."""
    w = weight.detach().float()
    out, inputs = w.shape
    if out % block or inputs % block:
        raise ValueError(f"a [{out}, {inputs}] weight is not whole blocks of {block}")
    blocks = w.reshape(out // block, block, inputs // block, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(out, inputs)
    return {"weight": q, "weight_scale_inv": scale.contiguous()}


# the saved tensors `_write_saved` quantizes: the projections, and Mixtral's experts' matrices (``w1``, ``w2``, ``w3``)
_QUANTIZED_SAVED = re.compile(r"(_proj|\.experts\.\d+\.w[123])\.weight$")


def _write_saved(
    model: Any, out_dir: Path, fmt: str, block: int, act_order: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """`model` saved as transformers publishes it (a mixture of experts: each expert's matrices), each
    ``*_proj.weight`` (and Mixtral's experts' ``w1``-``w3``) then quantized: to fp8 by blocks of `block`
    (``fp8-block``), or per channel or tensor; or to AWQ's or GPTQ's 4-bit codes by groups of `block` inputs (as
    AutoAWQ and GPTQModel publish a Qwen3-MoE: every expert's matrices too, the router float; GPTQ's `act_order`)."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out_dir)
    files = sorted(out_dir.glob("*.safetensors"))
    written: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        state = load_file(str(file))
        for name in [n for n, t in state.items() if _QUANTIZED_SAVED.search(n) and t.dim() == 2]:
            weight = state.pop(name)
            tensors = _tensors_of(weight, fmt, block, act_order)
            state.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in tensors.items()})
            written[name.removesuffix(".weight")] = tensors
        save_file(state, str(file), metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():  # the scales' files: their weights'
        data = json.loads(index.read_text())
        for name, tensors in written.items():
            for key in tensors:
                data["weight_map"][f"{name}.{key}"] = data["weight_map"][f"{name}.weight"]
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = _config(fmt, block, act_order)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return written


def _config(fmt: str, group: int, act_order: bool) -> dict[str, object]:
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [group] * 2}
    if fmt.startswith("fp8"):
        strategy = "tensor" if fmt == "fp8-tensor" else "channel"
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
        }
    if fmt == "fbgemm-fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 8 if fmt == "gptq-int8" else 4,
        "group_size": group,
        "desc_act": act_order,
        "sym": fmt == "gptq-int8",
        "checkpoint_format": "gptq",
    }


def write_quantized(
    model: Any, out_dir: Path, fmt: str, group: int = 128, act_order: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Save `model` (a transformers causal LM) into `out_dir` as a `fmt` checkpoint (``config.json``
    with its ``quantization_config``, ``model.safetensors``); the tokenizer is the caller's. Returns the
    quantized tensors written, by linear name."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    experts = any(name.endswith(".experts") for name, _ in model.named_modules())
    if fmt == "fp8-block" or experts:
        return _write_saved(model, out_dir, fmt, group, act_order)
    head = model.get_output_embeddings()
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    written: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module is head:
            continue
        weight = module.weight.detach().cpu()
        tensors = _tensors_of(weight, fmt, group, act_order)
        state.pop(f"{name}.weight")
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
        written[name] = tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = _config(fmt, group, act_order)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)
    return written
