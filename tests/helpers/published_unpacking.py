"""AWQ's and GPTQ's published unpacking (AutoAWQ's ``reverse_awq_order``, AutoGPTQ's words of 4- or 8-bit codes and
its v1 zeros), written out as the
reference the loaders' own unpacking is checked against (tests/unit/test_quantized_checkpoints.py,
tests/unit/test_moe_fast.py): a linear's stored tensors by their short names (``qweight``, ``qzeros``, ``scales``,
``g_idx``) to its float weight ``[out, in]``."""

from __future__ import annotations

import torch


def ref_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4)
    w = (t["qweight"][:, :, None] >> shifts[None, None, :]).view(t["qweight"].shape[0], -1)
    z = (t["qzeros"][:, :, None] >> shifts[None, None, :]).view(t["qzeros"].shape[0], -1)
    reverse = torch.arange(w.shape[-1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)  # reverse_awq_order
    w, z = w[:, reverse] & 0xF, z[:, reverse] & 0xF
    z = z.repeat_interleave(group, dim=0)
    s = t["scales"].float().repeat_interleave(group, dim=0)
    return ((w - z).float() * s).t()  # [in, out] -> the linear's [out, in]


def ref_gptq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    bits = 32 * t["qweight"].shape[0] // t["g_idx"].numel()  # 4, or 8 (Qwen's GPTQ-Int8): 32 / bits codes a word
    wf, mask = torch.arange(0, 32, bits, dtype=torch.int32), (1 << bits) - 1
    zeros = (t["qzeros"][:, :, None] >> wf[None, None, :]) & mask
    zeros = (zeros + 1).reshape(t["scales"].shape)  # v1 checkpoints store zero - 1
    weight = (t["qweight"][:, None, :] >> wf[None, :, None]) & mask
    weight = weight.reshape(-1, weight.shape[-1])  # [in, out]
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (weight - zeros[g]).float()).t()
