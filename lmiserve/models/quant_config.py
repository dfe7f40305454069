"""Which quantized format a checkpoint holds, from its ``config.json``'s ``quantization_config`` (issue #39): one
`QuantSpec`, or a `ModelLoadError` of one line for a format lmiserve does not read.

- ``compressed-tensors`` (llm-compressor's output, as RedHatAI and others publish it): every config group's weights
  8-bit floats per channel or per tensor (``float-quantized``: FP8, FP8_DYNAMIC), 4-bit integers per group or
  per channel, symmetric or not, ``pack-quantized`` without quantized activations (W4A16, W4A16_ASYM: what its GPTQ
  and AWQ modifiers write), or 8-bit integers per group or channel (``int-quantized``: W8A8, whose 8-bit integer
  activations a GPU keeping the codes may quantize by token, `QuantSpec.int8_activations`, elsewhere left
  unquantized; ``pack-quantized``: W8A16). One scheme a checkpoint: groups of other schemes beside it
  are refused.
- ``fbgemm_fp8``; ``fp8`` (AutoFP8, vLLM's; with ``weight_block_size``: block-wise scales); ``mxfp4`` (gpt-oss);
  ``awq`` (GEMM packing with zero points) and ``gptq`` (``gptq`` or ``gptq_v2``), 4 bits.
- ``modelopt`` (NVIDIA's Model Optimizer, as NVIDIA publishes its ``-FP8`` checkpoints; the ``quantization_config``
  its export writes into ``config.json``, or its older ``hf_quant_config.json``, `modelopt_config`): ``quant_algo``
  ``FP8`` (a scale a tensor, a static ``input_scale``), ``FP8_PER_CHANNEL_PER_TOKEN`` (a scale an output channel)
  and ``FP8_PB_WO`` (a scale a block of 128 x 128, ``weight_scale`` ``[row blocks, 1, input blocks, 1]``). Its
  other algorithms (NVFP4, MXFP8, its W4A16 AWQ and W8A8 SmoothQuant) are refused in one line."""

from __future__ import annotations

from typing import Any

from lmiserve.engine.model.quant_formats import MODELOPT, QuantSpec
from lmiserve.models.errors import ModelLoadError

__all__ = ["MODELOPT", "checkpoint_spec", "compressed_tensors_spec", "modelopt_config"]

COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT_BLOCK = (128, 128)  # FP8_PB_WO's blocks (rows, inputs): ModelOpt's 2-D block-wise fp8, as vLLM reads it


def checkpoint_spec(qc: dict[str, Any]) -> QuantSpec:
    """The format of the quantization config `qc` (a ``config.json``'s ``quantization_config``)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == COMPRESSED_TENSORS:
        return compressed_tensors_spec(qc)
    if method.startswith(MODELOPT):  # (vLLM's modelopt_fp4 too: its algorithm is refused below)
        return _modelopt_spec(qc)
    if method == "fbgemm_fp8":
        return QuantSpec("fp8", method)
    if method == "mxfp4":
        return QuantSpec("mxfp4", method)
    if method == "fp8":
        block = qc.get("weight_block_size")
        return QuantSpec("fp8", method, blocks=(int(block[0]), int(block[1])) if block else None)
    if method in ("awq", "gptq"):
        bits = qc.get("bits", qc.get("w_bit"))
        group = int(qc.get("group_size", qc.get("q_group_size", -1)) or -1)
        if bits != 4 and (method, bits) != ("gptq", 8):
            says = "lmiserve reads 4-bit AWQ, 4- or 8-bit GPTQ"
            raise ModelLoadError(f"{method} with {bits} bits is not supported: {says}")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or qc.get("zero_point", True) is False:
                raise ModelLoadError(f"awq version {version!r} without GEMM packing and zero points is not supported")
            return QuantSpec("awq", method, group)
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"gptq checkpoint_format {fmt!r} is not supported: use gptq or gptq_v2")
        return QuantSpec("gptq", method, group, v1_zeros=fmt == "gptq", code_bits=8 if bits == 8 else 4)
    raise ModelLoadError(
        f"quant_method {method or None!r} is not supported: lmiserve reads compressed-tensors (fp8, 4-bit and "
        "8-bit integers), fbgemm_fp8, fp8, modelopt (fp8), awq, gptq and mxfp4"
    )


def modelopt_config(data: Any) -> dict[str, Any] | None:
    """A ModelOpt ``hf_quant_config.json``'s content (``{"producer": {"name": "modelopt"}, "quantization": {...}}``:
    what its export wrote before it wrote a ``quantization_config`` into ``config.json``) as a quantization config;
    None when it is not ModelOpt's."""
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        return None
    producer = data.get("producer")
    if isinstance(producer, dict) and str(producer.get("name", MODELOPT)).lower() != MODELOPT:
        return None
    return {**data, "quant_method": MODELOPT}


def _modelopt_spec(qc: dict[str, Any]) -> QuantSpec:
    """A ModelOpt config's algorithm (``quant_algo``, beside ``quant_method`` or in its ``quantization``)."""
    inner = qc.get("quantization")
    section: dict[str, Any] = inner if isinstance(inner, dict) else qc
    algo = str(section.get("quant_algo") or "").upper()
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        return QuantSpec("fp8", MODELOPT)  # (FP8's static input_scale is not used: activations per token)
    if algo == "FP8_PB_WO":
        return QuantSpec("fp8", MODELOPT, blocks=MODELOPT_BLOCK)
    raise ModelLoadError(
        f"ModelOpt quant_algo {algo or None!r} is not supported: lmiserve reads ModelOpt's FP8, "
        "FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO"
    )


def compressed_tensors_spec(qc: dict[str, Any]) -> QuantSpec:
    """A compressed-tensors config's one scheme (`checkpoint_spec`'s first case)."""
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    if not groups:
        raise ModelLoadError("a compressed-tensors quantization_config without config_groups: nothing is quantized")
    specs = {_scheme(group, group.get("format") or qc.get("format")) for group in groups}
    if len(specs) > 1:
        raise ModelLoadError(
            f"compressed-tensors groups of {len(specs)} schemes in one checkpoint are not supported: lmiserve reads "
            "one (fp8, 4-bit or 8-bit integers)"
        )
    return specs.pop()


def _scheme(group: dict[str, Any], fmt: Any) -> QuantSpec:
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if (kind, bits) == ("float", 8) and strategy in ("channel", "tensor"):
        return QuantSpec("fp8", COMPRESSED_TENSORS)  # (activations: quantized per token at each call)
    if (kind, bits) == ("int", 8) and strategy in ("group", "channel") and fmt in ("int-quantized", "pack-quantized"):
        activations = group.get("input_activations")
        if activations and activations.get("type") != "int":
            raise ModelLoadError(
                f"compressed-tensors 8-bit integer weights with {activations.get('type')} activations are not "
                "supported: lmiserve reads W8A8 (int8 activations) and W8A16"
            )
        size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        int8_rows = activations is not None and activations.get("num_bits") == 8  # W8A8 (any strategy: per token)
        return QuantSpec("int8", COMPRESSED_TENSORS, size, packed=fmt == "pack-quantized", int8_activations=int8_rows)
    if (kind, bits) == ("int", 4) and strategy in ("group", "channel") and fmt == "pack-quantized":
        activations = group.get("input_activations")
        if activations:
            raise ModelLoadError(
                f"compressed-tensors 4-bit weights with {activations.get('type')} {activations.get('num_bits')}-bit "
                "activations (W4A8) are not supported: lmiserve reads W4A16 (activations unquantized)"
            )
        size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        return QuantSpec("gptq", COMPRESSED_TENSORS, size, packed=True)
    raise ModelLoadError(
        f"compressed-tensors weights {kind} {bits}-bit by {strategy} ({fmt}) are not supported: lmiserve reads 8-bit "
        "floats by channel or tensor, 8-bit integers by group or channel, and 4-bit integers by group or channel as "
        "pack-quantized"
    )
