"""Quantized checkpoints (issue #39): which format a model directory holds (its ``config.json``'s
``quantization_config``), checked against the user's ``quantize`` option, and the model built from the
checkpoint's own tensors by lmiserve (no compressed-tensors, AutoAWQ or GPTQ package needed).

Formats (`engine/model/quant_formats.py` says how each is stored and run):
- ``quant_method: compressed-tensors`` whose weights are 8-bit floats, per channel or per tensor
  (``weight``, ``weight_scale``, an ``input_scale`` ignored: activations are quantized per token);
  ``quant_method: fbgemm_fp8`` (per channel); ``quant_method: fp8`` without blocks (AutoFP8 / vLLM's,
  per tensor): ``quantize=fp8``. ``quant_method: fp8`` with ``weight_block_size`` (block-wise scales: Qwen3's and
  DeepSeek's FP8 releases): read by lmiserve too, each linear kept fp8 on a GPU where the loader keeps it
  (`fp8_gemv.weights_kept_for`), else dequantized at load (exactly: each weight is its fp8 value times its block's
  scale); a vision-language model's dequantized by transformers. A mixture of experts' fp8 experts (each expert's
  matrices with their scales, by blocks too, as compressed-tensors publishes Qwen3-MoE and Mixtral and Qwen3-MoE's
  FP8 release stores them) are de-quantized at load (their products are transformers' grouped ones), or on a GPU
  where they would not fit so kept fp8 on `fp8_experts`' grouped kernel.
- ``quant_method: compressed-tensors`` whose weights are 4-bit integers by group or channel, ``pack-quantized``
  (llm-compressor's W4A16 and W4A16_ASYM, from its GPTQ or AWQ modifiers): ``quantize=gptq`` or ``awq``; the
  4-bit codes run as AWQ's and GPTQ's do. ``quantize=compressed-tensors`` (vLLM's word) takes either scheme.
- ``quant_method: compressed-tensors`` whose weights are 8-bit integers (W8A8 ``int-quantized``, its activations
  left unquantized; W8A16 ``pack-quantized``): ``quantize=compressed-tensors``; on a CPU computing in bf16 a
  symmetric weight by channel runs torch's int8 kernel (`Int8Linear`), else each is de-quantized at load.
- ``quant_method: awq``, 4 bits, GEMM packing, with zero points: ``quantize=awq``.
- ``quant_method: gptq``, 4 bits (``checkpoint_format`` ``gptq``, or ``gptq_v2``), any ``desc_act``:
  ``quantize=gptq``.
- ``quant_method: mxfp4`` (gpt-oss's experts: 4-bit floats, a power-of-two scale a block of 32): on a GPU where
  de-quantized they would not fit, kept MXFP4 on a grouped Triton kernel; on a CPU in fp32, kept MXFP4 on its f4
  kernel; else dequantized at load by transformers (`models.mxfp4_load`): ``quantize=mxfp4``.
- ``quant_method: modelopt`` (NVIDIA's Model Optimizer; in ``config.json``, or its older ``hf_quant_config.json``
  beside it): ``FP8`` (a scale a tensor; its static ``input_scale`` is not used: activations are quantized per
  token), ``FP8_PER_CHANNEL_PER_TOKEN`` (a scale a channel) and ``FP8_PB_WO`` (a scale a block of 128 x 128, run as
  block-wise fp8 above): ``quantize=fp8`` or ``modelopt`` (vLLM's word). The checkpoint's KV cache scales
  (``k_proj.k_scale``, ``v_proj.v_scale``) serve ``kv_cache_dtype=fp8`` (engine/attention/kv_quant.py).
- ``quantize=fp8`` on a float checkpoint: its linears (not the output projection) quantized to fp8 per
  output channel at load (vLLM's dynamic fp8).

Anything else (another method, other bits, a ``quantize`` that is not the checkpoint's)
is refused with one line (`ModelLoadError`)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from lmiserve.engine.model import expert_codes, fp8_experts, grouped_experts, int4_experts, int8_experts, mxfp4_experts
from lmiserve.engine.model.cpu_experts import kernel_named
from lmiserve.engine.model.expert_matrices import stacked_experts
from lmiserve.engine.model.fp8_ops import per_tensor_at_load
from lmiserve.engine.model.int4_triton import Int4TritonLinear
from lmiserve.engine.model.int8_weights import Int8WeightLinear
from lmiserve.engine.model.language_model import text_part
from lmiserve.engine.model.packed_codes import stored_int_parts
from lmiserve.engine.model.quant_formats import (
    MODELOPT,
    Int4Parts,
    QuantSpec,
    block_grid,
    fp8_module,
    int4_module,
    quantize_fp8,
    unpack_awq,
    unpack_gptq,
    weights_kept_for,
)
from lmiserve.engine.model.quantize import Int4Linear, Int8Linear, Q8Linear, replace_linears
from lmiserve.engine.model.shard_checkpoint import model_names
from lmiserve.engine.model.shard_quantized import dequantizing_reader
from lmiserve.engine.model.sharding import experts_layout
from lmiserve.models import mxfp4_load
from lmiserve.models.attention_choice import sdpa_or_default
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.int4_load import SafetensorsFiles, meta_tensors, safetensors_names
from lmiserve.models.quant_config import COMPRESSED_TENSORS, checkpoint_spec, modelopt_config
from lmiserve.models.quant_pack import rtn_int4

__all__ = [
    "QUANTIZE_METHODS",
    "QuantSpec",
    "checkpoint_quantization",
    "load_quantized",
    "quantize_at_load",
    "quantize_fp8_dynamic",
    "quantize_int4_dummy",
]

logger = logging.getLogger(__name__)

QUANTIZE_METHODS = ("fp8", "awq", "gptq", "mxfp4", COMPRESSED_TENSORS, MODELOPT)
FORMAT_WORDS = {COMPRESSED_TENSORS, MODELOPT}  # `quantize` values that name a checkpoint's format, not its method
DUMMY_GROUP = 128  # load_format=dummy with quantize=awq|gptq: groups of this many inputs (AWQ's and GPTQ's usual)


def checkpoint_quantization(path: Path, quantize: str | None, load_format: str = "auto") -> QuantSpec | None:
    """What `path` holds and `quantize` asks, as one `QuantSpec` (None: a float model, run as it is); a
    `ModelLoadError` of one line when they disagree or the format is not one lmiserve reads."""
    quantize = (quantize or "").strip().lower() or None
    if quantize is not None and quantize not in QUANTIZE_METHODS:
        raise ModelLoadError(
            f"quantize={quantize} is not supported: use fp8, awq, gptq, mxfp4, compressed-tensors or modelopt (or "
            "leave it unset)"
        )
    config = _config_json(path)
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    qc = qc or modelopt_config(_config_json(path, "hf_quant_config.json"))
    if load_format == "dummy":  # random weights, quantized at load (a benchmark's model of a shape)
        if quantize is None:
            return None
        if quantize in FORMAT_WORDS:
            raise ModelLoadError(
                f"quantize={quantize} names a checkpoint's format: a dummy load takes fp8, awq or gptq"
            )
        return QuantSpec("fp8", "dynamic") if quantize == "fp8" else QuantSpec(quantize, "dummy", DUMMY_GROUP)
    if not qc:
        if quantize is None or quantize == "fp8":
            return QuantSpec("fp8", "dynamic") if quantize else None
        raise ModelLoadError(
            f"quantize={quantize}: {path.name} is not a {quantize.upper()} checkpoint (no quantization_config "
            "in its config.json); only quantize=fp8 quantizes a float checkpoint at load"
        )
    spec = checkpoint_spec(qc)
    named = COMPRESSED_TENSORS if spec.method == "int8" else spec.method  # (no LMI or TGI word names int8)
    names = {named} | ({"awq", "gptq"} if spec.packed and spec.bits == 4 else set())  # (W4A16: GPTQ's or AWQ's)
    if quantize is not None and quantize not in names | (FORMAT_WORDS & {spec.source}):
        raise ModelLoadError(
            f"quantize={quantize}, but {path.name} is a {spec.method} checkpoint ({spec.source}): "
            f"set quantize={named} or leave it unset"
        )
    return spec


def _config_json(path: Path, name: str = "config.json") -> dict[str, Any]:
    try:
        data = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_quantized(
    path: Path,
    spec: QuantSpec,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    auto_class: Any = None,
) -> tuple[torch.nn.Module, str]:
    """The model of the quantized checkpoint `path` computing in `dtype` on `device` and an account of
    its linears: the architecture of `auto_class` (default: causal LMs; a vision-language model's) on the meta
    device, each linear the checkpoint stores quantized made from its tensors (`quant_formats`; a VLM's tensors
    found by the names transformers gives them, `shard_checkpoint.model_names`), the other tensors read as they
    are; or, for gpt-oss's MXFP4 experts, `mxfp4_load`'s."""
    from transformers import AutoModelForCausalLM

    architecture = auto_class or AutoModelForCausalLM
    if spec.method == "mxfp4":  # (gpt-oss's experts: kept where `mxfp4_experts.kept_for` says, else de-quantized)
        found = safetensors_names(path)
        model = None if found is None else meta_model(path, dtype, trust_remote_code, architecture)
        if model is not None and mxfp4_experts.kept_for(model, device, path.name):
            return mxfp4_load.load_kept(model, path, cast(dict[str, Path], found), device)
        return mxfp4_load.load_dequantized(path, dtype, trust_remote_code, architecture)
    stored = safetensors_names(path)
    if stored is None:
        raise ModelLoadError(f"{path.name}: a {spec.method} checkpoint needs its weights as safetensors")
    model = meta_model(path, dtype, trust_remote_code, architecture)
    kinds: Counter[str] = Counter()
    file_names = model_names(model, stored)  # (a VLM's published names are not its modules': transformers renames)
    stored = {name: stored[stored_name] for name, stored_name in file_names.items()}
    with SafetensorsFiles(stored, file_names) as files:
        targets = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
        keep = weights_kept_for(model, device, path.name, spec.kernel_family, spec.blocks is not None)
        for name in targets:
            made = _linear_of(files, stored, name, spec, dtype, device, keep)
            if made is None:
                continue
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, made)
            kinds[_kind_name(made)] += 1
        if not kinds:
            raise ModelLoadError(f"{path.name}: its config says {spec.source}, but no linear has quantized tensors")
        kinds.update(_fill_experts(model, files, stored, spec, path, device, keep))
        files.fill(model)  # embeddings, norms, the output projection and any linear stored float
    left = [name for name, _ in meta_tensors(model)]
    if left:
        raise ModelLoadError(f"{path.name}: {', '.join(left[:5])} left without values")
    account = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return model, f"{spec.method} checkpoint ({spec.source}): {account}"


def meta_model(path: Path, dtype: torch.dtype, trust_remote_code: bool, architecture: Any) -> Any:
    """The model of the checkpoint `path` (`architecture`: an auto class of transformers) on the meta device computing
    in `dtype`, without its quantization config (lmiserve builds the quantized layers), its generation config read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # lmiserve builds the linears; transformers' quantizers are not used
    with init_empty_weights(include_buffers=False):
        model = sdpa_or_default(
            path, lambda **sdpa: architecture.from_config(  # (a copy each: a refused try edits the config)
                copy.deepcopy(config), dtype=dtype, trust_remote_code=trust_remote_code, **sdpa
            )
        )  # fmt: skip
    model.tie_weights()
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    model.config.name_or_path = str(path)
    return model


def _fill_experts(
    model: torch.nn.Module,
    files: SafetensorsFiles,
    stored: dict[str, Path],
    spec: QuantSpec,
    path: Path,
    device: torch.device,
    keep: bool | None = None,
) -> Counter[str]:
    """A mixture of experts' experts (the merged ``gate_up_proj`` and ``down_proj`` transformers' modules hold) from
    the checkpoint's matrices of each expert, as compressed-tensors, FBGEMM, AutoAWQ and GPTQModel publish them (fp8
    matrices with their scales, compressed-tensors' integer codes, AWQ's or GPTQ's 4-bit or 8-bit codes;
    `stacked_experts`): fp8 ones kept fp8 on a GPU where `fp8_experts.kept_for` says so, 4-bit and 8-bit ones kept as
    their codes where the linears are (`keep`: their `weights_kept_for`, one decision logged once; None, as on a CPU:
    `int4_experts.kept_for` or `int8_experts.kept_for` is asked), else de-quantized (`dequantizing_reader`: their
    products are transformers' grouped ones); how many experts modules of each kind. Experts stored otherwise are
    refused in one line."""
    read = dequantizing_reader(files.slice, stored, spec)
    made: Counter[str] = Counter()
    if spec.method == "fp8":
        kept = fp8_experts.keep_stored(model, stored, files.slice, spec.blocks, device, path.name)
        made[f"experts modules kept fp8 ({_experts_kernel(model, kept)})"] = len(kept)
    else:
        codes = int8_experts if spec.bits == 8 else int4_experts
        kept = expert_codes.keep_stored(model, stored, files.slice, spec, device, path.name, codes, decided=keep)
        made[f"experts modules kept {codes.KEPT} ({_experts_kernel(model, kept)})"] = len(kept)
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        if not name.endswith(".experts") or grouped_experts.kept(module) or not isinstance(down, torch.Tensor):
            continue
        count = int(down.shape[0])
        for kind in ("gate_up_proj", "down_proj"):
            meta = getattr(module, kind, None)
            if not isinstance(meta, torch.Tensor) or not meta.is_meta or f"{name}.{kind}" in stored:
                continue
            value = stacked_experts(name, kind, count, stored, read, lambda size: slice(0, size))
            if value is None or experts_layout(module)[0] or tuple(value.shape) != tuple(meta.shape):
                raise ModelLoadError(
                    f"{path.name}: the experts of {name} are not stored as lmiserve reads a {spec.method} mixture of "
                    "experts (each expert's matrices: fp8, or 4-bit or 8-bit integer codes)"
                )
            setattr(module, kind, torch.nn.Parameter(value.to(meta.dtype), requires_grad=False))
            made[f"experts modules de-quantized to {str(meta.dtype).removeprefix('torch.')}"] += kind == "down_proj"
    return +made


def _experts_kernel(model: torch.nn.Module, kept: set[str]) -> str:
    """What the start's account calls the kernel of the kept experts modules `kept` of `model`."""
    return kernel_named([model.get_submodule(name) for name in kept])


def _linear_of(
    files: SafetensorsFiles,
    stored: dict[str, Path],
    name: str,
    spec: QuantSpec,
    dtype: torch.dtype,
    device: torch.device,
    keep: bool | None = None,
) -> torch.nn.Module | None:
    """The layer of the linear `name` from its quantized tensors (`keep`: `weights_kept_for`'s); None when the
    checkpoint stores it float."""

    def get(key: str) -> torch.Tensor | None:
        return files.tensor(f"{name}.{key}") if f"{name}.{key}" in stored else None

    bias = get("bias")
    if spec.method == "fp8":
        scale = get(spec.codes_key)  # (block-wise: transformers' name, ModelOpt's own)
        if scale is None:
            return None
        weight = files.tensor(f"{name}.weight")
        if weight.dtype != torch.float8_e4m3fn:
            raise ModelLoadError(f"{name}.weight is {weight.dtype}, not float8_e4m3fn")
        if spec.blocks:
            try:
                scale = block_grid(scale, weight.shape, spec.blocks)
            except ValueError as error:
                raise ModelLoadError(f"{name}: {error}") from None
        return fp8_module(weight, scale, bias, dtype, device, keep, spec.blocks)
    if spec.int_codes:
        if get(spec.codes_key) is None:
            return None
        try:
            return int4_module(stored_int_parts(name, get, spec), bias, dtype, device, keep)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    qweight = get("qweight")
    if qweight is None:
        return None
    qzeros, scales = files.tensor(f"{name}.qzeros"), files.tensor(f"{name}.scales")
    if spec.method == "awq":
        parts = unpack_awq(qweight, qzeros, scales, spec.group_size)
    else:
        parts = unpack_gptq(qweight, qzeros, scales, get("g_idx"), spec.group_size, spec.v1_zeros, spec.code_bits)
    return int4_module(parts, bias, dtype, device, keep)


def _kind_name(module: torch.nn.Module) -> str:
    if isinstance(module, Int4Linear):
        return "on the int4 kernel"
    if isinstance(module, Int4TritonLinear):
        return "on the Triton int4 kernel"
    if isinstance(module, Int8Linear):
        return "on the int8 kernel"
    if isinstance(module, Int8WeightLinear):
        return "int8 codes on the Triton kernel"
    if isinstance(module, Q8Linear):  # (a CPU's 8-bit codes: `cpu_codes`)
        return f"{'fp8' if module.weight.dtype == torch.float8_e4m3fn else 'int8'} codes on the q8 kernel"
    if type(module) is torch.nn.Linear:
        return f"de-quantized to {str(module.weight.dtype).removeprefix('torch.')}"
    return "fp8 weights"


def quantize_at_load(model: torch.nn.Module, spec: QuantSpec, dtype: torch.dtype, device: torch.device) -> str:
    """What `spec` makes at load of `model`'s float weights (a whole model's, or a tensor-parallel rank's shard):
    fp8 of ``quantize=fp8`` on a float checkpoint (`quantize_fp8_dynamic`), 4-bit codes of a dummy model's random
    weights (`quantize_int4_dummy`). An account of what was done."""
    if spec.dynamic:
        return quantize_fp8_dynamic(model, dtype, device)
    if spec.source != "dummy":
        raise ValueError(f"a {spec.method} checkpoint ({spec.source}) is read as stored, not quantized at load")
    return quantize_int4_dummy(model, spec, dtype, device)


def quantize_fp8_dynamic(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """`quantize=fp8` on a float model: every linear but the output projection (of a VLM: its decoder's) quantized
    to fp8, per tensor on a GPU with fp8 products, else per output channel (`fp8_ops.per_tensor_at_load`;
    `quant_formats.quantize_fp8`), then `fp8_module` (fp8 products where the device has them, else
    de-quantized once into `dtype`); a mixture of experts' experts too, per output channel, where
    `fp8_experts.kept_for` keeps them fp8 (else they stay float). An account of what was done."""

    keep = weights_kept_for(model, device, "quantize=fp8", "fp8")
    per_tensor = per_tensor_at_load(device)

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        weight, scale = quantize_fp8(linear.weight, per_tensor=per_tensor)
        return fp8_module(weight, scale, linear.bias, dtype, device, keep)

    scales = "per tensor" if per_tensor else "per output channel"
    account = f"fp8 quantized at load, {scales}: {_made_at_load(model, make)}"
    experts = fp8_experts.quantize_servable(model, device, "quantize=fp8")
    if experts:
        kernel = kernel_named([m for m in model.modules() if grouped_experts.kept(m)])
        account += f"; {experts} experts modules kept fp8 per output channel ({kernel})"
    return account


def quantize_int4_dummy(model: torch.nn.Module, spec: QuantSpec, dtype: torch.dtype, device: torch.device) -> str:
    """`load_format=dummy` with `quantize=awq|gptq` (a benchmark's 4-bit model of a shape, as vLLM's dummy
    loader makes one): every linear but the output projection rounded to 4-bit codes (RTN, groups of
    `spec.group_size` consecutive inputs, or one group a row where that does not divide them) and made as
    a checkpoint's would be (`int4_module`). An account of what was done."""

    def make(linear: torch.nn.Linear) -> torch.nn.Module:
        weight = linear.weight.detach()
        inputs = weight.shape[1]
        group = spec.group_size if inputs % spec.group_size == 0 else inputs
        g_idx = torch.arange(inputs, device=weight.device) // group
        codes, scale, zero = rtn_int4(weight, g_idx, inputs // group)
        return int4_module(Int4Parts(codes.to(torch.uint8), scale.float(), zero, g_idx), linear.bias, dtype, device)

    account = _made_at_load(model, make)
    return f"{spec.method} codes made at load from random weights (load_format=dummy): {account}"


def _made_at_load(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> str:
    """Every linear of `model` but the output projection (of a VLM: of its decoder, `text_part`) replaced by `make`'s
    layer; how many of each kind."""
    kinds: Counter[str] = Counter()

    def counted(linear: torch.nn.Linear) -> torch.nn.Module:
        made = make(linear)
        kinds[_kind_name(made)] += 1
        return made

    part = text_part(model)
    replace_linears(part, lambda m: True, counted)
    account = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return account if part is model else f"{account} (the decoder's; the vision tower and projector kept as loaded)"
