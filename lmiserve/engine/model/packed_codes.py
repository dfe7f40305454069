"""compressed-tensors' integer weights (issue #39) as the codes, scales and zeros AWQ's and GPTQ's are unpacked into
(`quant_formats.Int4Parts`), so every layer after is theirs (`quant_formats.int4_module`, `int8_module`):

- ``pack-quantized`` (llm-compressor's W4A16 and W4A16_ASYM, from its GPTQ or AWQ modifiers; W8A16): ``weight_packed``
  int32 ``[out, in * bits / 32]`` packing its inputs in order, each the signed code plus ``2 ** (bits - 1)``;
  ``weight_scale`` ``[out, groups]`` (``[out, 1]`` by channel); ``weight_shape`` ``[out, in]``; with asymmetric
  weights ``weight_zero_point`` int32 ``[out * bits / 32, groups]`` packing outputs in order, plus the same offset
  (earlier releases: ``[out, groups * bits / 32]``); ``weight_g_idx`` ``[in]`` where the groups were ordered by
  activations. A symmetric weight's zero is the offset in these terms.
- ``int-quantized`` (W8A8): ``weight`` int8 ``[out, in]``, ``weight_scale``, a ``weight_zero_point`` int8 where
  asymmetric."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmiserve.engine.model.quant_formats import Int4Parts, QuantSpec, unpack_words

__all__ = ["PACKED_KEYS", "int_parts", "stored_int_parts", "unpack_int8", "unpack_packed"]

PACKED_KEYS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def stored_int_parts(name: str, get: Callable[[str], torch.Tensor | None], spec: QuantSpec) -> Int4Parts:
    """`int_parts` of the linear `name` from the tensors `get` reads by their short names (None: not stored)."""
    stored = {key: value for key in (*PACKED_KEYS, "weight") if (value := get(key)) is not None}
    return int_parts(stored, spec, name)


def int_parts(tensors: dict[str, torch.Tensor], spec: QuantSpec, name: str = "a linear") -> Int4Parts:
    """compressed-tensors' integer tensors of the linear `name` (`PACKED_KEYS`, and ``weight`` where not packed) as
    codes ``[out, in]`` and ``[out, groups]`` scales and zeros, 4 or 8 bits as `spec` says (`unpack_packed`,
    `unpack_int8`). A `ValueError` naming `name` where the tensors do not fit together."""
    if spec.packed:
        return unpack_packed(tensors, spec.group_size, name, spec.bits)
    return unpack_int8(tensors, spec.group_size, name, spec.int8_activations)


def unpack_packed(
    tensors: dict[str, torch.Tensor], group_size: int, name: str = "a linear", bits: int = 4
) -> Int4Parts:
    """compressed-tensors' ``pack-quantized`` tensors of the linear `name` (`PACKED_KEYS`: ``weight_packed``,
    ``weight_scale``, ``weight_shape``, and ``weight_zero_point``, ``weight_g_idx`` where stored), codes of `bits`
    (4, or 8: W8A16), as codes ``[out, in]`` and ``[out, groups]`` scales and zeros (`group_size`: the config's; -1
    by channel). A `ValueError` naming `name` where the tensors do not fit together."""
    missing = [key for key in PACKED_KEYS[:3] if key not in tensors]
    if missing:
        raise ValueError(f"{name}: {', '.join(missing)} not in the checkpoint beside its weight_packed")
    out, inputs = (int(v) for v in tensors["weight_shape"].tolist())
    packed, per_word = tensors["weight_packed"], 32 // bits
    if packed.dtype != torch.int32 or packed.shape[0] != out or packed.shape[1] * per_word < inputs:
        shape = f"{tuple(packed.shape)} {str(packed.dtype).removeprefix('torch.')}"
        raise ValueError(f"{name}: weight_packed {shape} does not hold the {bits}-bit codes of {out}x{inputs}")
    codes = unpack_words(packed, bits).reshape(out, -1)[:, :inputs]
    scale = _scale_of(tensors, out, name)
    groups = scale.shape[1]
    stored = tensors.get("weight_zero_point")
    if stored is None:
        zero = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32, device=codes.device)
    elif tuple(stored.shape) == (-(-out // per_word), groups):  # outputs packed (compressed-tensors' of 2025 on)
        zero = unpack_words(stored, bits).permute(0, 2, 1).reshape(-1, groups)[:out]
    elif tuple(stored.shape) == (out, -(-groups // per_word)):  # groups packed (earlier releases)
        zero = unpack_words(stored, bits).reshape(out, -1)[:, :groups]
    else:
        zeros = f"{out}x{groups}"
        raise ValueError(f"{name}: weight_zero_point {tuple(stored.shape)} fits neither packing of {zeros} zeros")
    g_idx = _groups_of(tensors, inputs, groups, group_size, name)
    return Int4Parts(codes.to(torch.uint8).contiguous(), scale.contiguous(), zero.contiguous(), g_idx, bits)


def unpack_int8(
    tensors: dict[str, torch.Tensor], group_size: int, name: str = "a linear", int8_rows: bool = False
) -> Int4Parts:
    """compressed-tensors' ``int-quantized`` tensors of the linear `name` (W8A8: ``weight`` int8 ``[out, in]``,
    ``weight_scale``, a ``weight_zero_point`` int8 ``[out, groups]`` where asymmetric) as 8-bit codes (each value
    plus 128) with ``[out, groups]`` scales and zeros; `int8_rows`: the checkpoint quantizes the activations to
    int8 (W8A8, `Int4Parts.int8_rows`)."""
    weight = tensors.get("weight")
    if weight is None or weight.dtype != torch.int8 or weight.dim() != 2 or "weight_scale" not in tensors:
        raise ValueError(f"{name}: an int-quantized linear is an int8 weight with its weight_scale")
    out, inputs = weight.shape
    scale = _scale_of(tensors, out, name)
    stored = tensors.get("weight_zero_point")
    zero = torch.zeros(scale.shape, dtype=torch.int32) if stored is None else stored.to(torch.int32)
    if zero.numel() != scale.numel():
        raise ValueError(
            f"{name}: weight_zero_point {tuple(zero.shape)} is not a zero for each scale {tuple(scale.shape)}"
        )
    codes = (weight.to(torch.int32) + 128).to(torch.uint8)
    g_idx = _groups_of(tensors, inputs, scale.shape[1], group_size, name)
    return Int4Parts(codes.contiguous(), scale.contiguous(), zero.reshape(scale.shape) + 128, g_idx, 8, int8_rows)


def _scale_of(tensors: dict[str, torch.Tensor], out: int, name: str) -> torch.Tensor:
    raw = tensors["weight_scale"].float()
    if raw.numel() % out and raw.numel() != 1:
        raise ValueError(f"{name}: weight_scale {tuple(raw.shape)} is not a scale for each of {out} outputs")
    return raw.reshape(1, 1).expand(out, 1) if raw.numel() == 1 else raw.reshape(out, -1)  # (by tensor: one)


def _groups_of(tensors: dict[str, torch.Tensor], inputs: int, groups: int, group_size: int, name: str) -> torch.Tensor:
    """Each input's group: ``weight_g_idx`` where stored (activation-ordered groups), else runs of `group_size`."""
    g_idx = tensors.get("weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(inputs) // (inputs if group_size <= 0 else group_size)
    if g_idx.numel() != inputs or int(g_idx.max()) >= groups or int(g_idx.min()) < 0:
        raise ValueError(f"{name}: the inputs' groups (weight_g_idx or group_size) are not its {groups} scales' groups")
    return g_idx.long()
