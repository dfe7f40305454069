"""Weight-only products ``x @ W.T`` with group-quantized weights on CPU (numba + explicit LLVM vector
code): 4-bit codes with a scale and a minimum per group of 32 inputs (`q4`, GGUF's Q4_0/Q4_1) and
8-bit codes with a scale per group of 16 or 32 inputs (`q8`: int8 codes, GGUF's Q8_0, Q6_K's 16; or fp8
e4m3fn values, an fp8 checkpoint's, `cpu_codes.fp8_layer`). ``x`` is fp32 ``[M, K]`` (any M), the output
fp32 ``[M, N]``, products and sums in fp32.

Why: decoding a few rows is bound by reading the weights. torch's int4 CPU kernel re-reads them for
each row (AMD EPYC, a 3072x576 matrix: 82/103/142/257 us at 1/2/4/8 rows) and wants bf16 inputs (a
round trip per product). These kernels read each weight once per call whatever M is.

Layout (blocked by 16 output rows, "lanes"): a weight of N outputs is stored as row blocks of 16
outputs (N padded to a multiple of 16 with zero rows), so that 16 consecutive bytes are the codes of
one input position for the 16 outputs of a block, and one vector instruction dequantizes 16 outputs:
- q4 codes: uint8 ``[N/16, K/2 * 16]``: block b, byte position i, lane l at ``[b, 16 i + l]``; byte i
  of a row holds the row's input ``32 g + j`` (``i = 16 g + j``) in its low nibble and input
  ``32 g + 16 + j`` in its high nibble (GGUF's ``qs`` order within a group);
  scales and minimums fp32 ``[N/16, K/32 * 32]``: ``[b, 32 g + l]`` the scale, ``[b, 32 g + 16 + l]``
  the minimum of group g of output ``16 b + l``. ``w = code * scale + min``.
- q8 codes: int8 or fp8 e4m3fn ``[N/16, K * 16]`` (``[b, 16 k + l]``), scales fp32 ``[N/16, K/G * 16]``
  (``[b, 16 g + l]``), ``w = code * scale``. fp8 bytes are widened exactly through fp16 (`group_tiles._e4m3_as_f32`), in
  tiles of up to `WIDE_TILE` rows: against fp32 (AMD EPYC Zen4, benchmarks/fp8_cpu.py), decode 1.8-4.8x
  faster, a 128-token prompt chunk 10-20 % slower (fp32's BLAS runs near the FMA peak there).
- f4 codes: 4-bit floats (e2m1, MXFP4's values: `cpu_experts.keep_mxfp4`) in q4's layout of codes, scales fp32
  ``[N/16, K/32 * 16]`` (``[b, 16 g + l]``), ``w = value(code) * scale``; widened exactly through fp16
  (`group_tiles._e2m1_as_f32`), in tiles of up to `WIDE_TILE` rows.
`pack_q4` / `pack_q8` / `pack_f4` build it from the natural ``[N, K]`` codes, `unpack_q4` / `unpack_q8` /
`unpack_f4` undo it. The compiled tiles are `group_tiles`'.

The kernel (one call per row block and up to `ROW_TILE` rows of x, fp8 and fp4 `WIDE_TILE`; blocks split among the
threads):
for each input k it converts the 16 outputs' codes to one fp32 vector and adds ``code * x[m, k]`` to
per-group sums of each row m (in registers); per group ``acc += sum * scale + min * sum(x of the
group)``. The conversion is shared by the rows and no horizontal sums are needed. Numerics: fp32
throughout; the group's ``sum(code * x)`` in 2-4 partial sums, scaled once (not ``w = code * scale +
min`` per weight): results differ from a float ``x @ W.T`` in the last bits, as two BLAS kernels do.

Measured (AMD EPYC Zen4, 2 threads; SmolLM2-135M's 120 layer products, weights from memory, ms for
1/2/4/8/9/16/32 rows): torch's int4 kernel with its bf16 round trips 4.95/5.94/7.83/13.7/18.9/23.9/
47.0, this q4 kernel 4.22/5.08/6.96/12.2/14.1/20.9/36.7; at 128 and 512 rows (3072x576) it also beats
fp32 BLAS on the dequantized matrix (2.3 vs 3.7 ms, 9.4 vs 13.2): it runs near the FMA peak, so every
row count goes through it. The q8 output projection (49152x576) at 1/2/8 rows: 0.70/0.83/3.1 ms (45
GB/s at 1 row) against 3.3/3.5/5.2 ms in fp32 through `cpu_gemm`. Per call ~8 us are fixed (the
parallel region's start, the numpy views). `Packed` (weights' numpy views made once) also forms the
input in the call (`PRE_RMS`: the RMS norm, `PRE_SILU_MUL`: ``silu(gate) * up``) and can add the
output to what ``out`` holds (the residual): engine/model/q4_decode.py's layers. Tried and slower:
per-weight dequantization (``code * scale + min`` then ``w * x``: 20% slower at 1 row), 4 codes a
32-bit lane instead of the byte loads, 8 rows a tile (register spills), 8 partial sums a row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA
from lmiserve.engine.model.group_tiles import LANES, PRE_NONE, PRE_RMS, PRE_SILU_MUL, Q4_GROUP, compiled

__all__ = [
    "LANES",
    "PRE_NONE",
    "PRE_RMS",
    "PRE_SILU_MUL",
    "Q4_GROUP",
    "Packed",
    "available",
    "blocked",
    "f4_linear",
    "pack_f4",
    "pack_q4",
    "pack_q8",
    "q4_linear",
    "q8_linear",
    "unpack_f4",
    "unpack_q4",
    "unpack_q8",
]

_F32 = npt.NDArray[np.float32]
_NO_NORM = np.zeros(0, dtype=np.float32)


# ---- layout -----------------------------------------------------------------------------------------
def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = (-t.shape[0]) % LANES
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked q4 layout of codes (0..15, ``[N, K]`` any int type) with fp32 ``scale`` and ``low``
    (``[N, K/32]``): ``(codes uint8 [N/16, K*8], scales fp32 [N/16, K])``."""
    k = codes.shape[1]
    packed = _nibbles(codes)
    s = torch.stack([_pad_rows(scale.float()), _pad_rows(low.float())], dim=-1)  # [N', G, 2]
    s = s.view(-1, LANES, k // Q4_GROUP, 2).permute(0, 2, 3, 1).contiguous().view(-1, k // Q4_GROUP * 2 * LANES)
    return packed, s


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[N, K]`` in q4's blocked layout of bytes ``[N/16, K/2 * 16]``."""
    k = codes.shape[1]
    if k % Q4_GROUP:
        raise ValueError(f"4-bit codes' inputs must be a multiple of {Q4_GROUP}, got {k}")
    c = _pad_rows(codes.to(torch.uint8)).view(-1, LANES, k // Q4_GROUP, 2, Q4_GROUP // 2)
    packed = c[..., 0, :] | (c[..., 1, :] << 4)  # [B, 16, G, 16]: byte j of group g
    return packed.reshape(-1, LANES, k // 2).transpose(1, 2).contiguous().view(-1, k // 2 * LANES)


def _codes_of(packed: torch.Tensor) -> torch.Tensor:
    """`_nibbles`' inverse: the codes ``[N', K]`` (uint8, N' a multiple of 16)."""
    half = packed.shape[1] // LANES
    b = packed.view(-1, half, LANES).transpose(1, 2).reshape(-1, half * 2 // Q4_GROUP, Q4_GROUP // 2)  # [N', G, 16]
    return torch.stack([b & 15, b >> 4], dim=2).reshape(-1, half * 2)


def pack_f4(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked f4 layout of e2m1 codes (0..15, ``[N, K]``) with fp32 `scale` ``[N, K/32]``: ``(codes uint8
    [N/16, K*8], scales fp32 [N/16, K/2])``."""
    if scale.shape != (codes.shape[0], codes.shape[1] // Q4_GROUP):
        raise ValueError(f"f4 scales {tuple(scale.shape)} do not match codes {tuple(codes.shape)}")
    s = _pad_rows(scale.float()).view(-1, LANES, scale.shape[1]).transpose(1, 2).contiguous()
    return _nibbles(codes), s.view(-1, scale.shape[1] * LANES)


def unpack_f4(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_f4`'s inverse: ``(codes uint8 [N, K], scale fp32 [N, K/32])``."""
    groups = scales.shape[1] // LANES
    return _codes_of(packed)[:n], scales.view(-1, groups, LANES).transpose(1, 2).reshape(-1, groups)[:n]


def unpack_q4(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_q4`'s inverse: ``(codes uint8 [N, K], scale fp32 [N, K/32], low fp32 [N, K/32])``."""
    groups = packed.shape[1] // LANES * 2 // Q4_GROUP
    codes = _codes_of(packed)[:n]
    s = scales.view(-1, groups, 2, LANES).permute(0, 3, 1, 2).reshape(-1, groups, 2)[:n]
    return codes, s[..., 0].contiguous(), s[..., 1].contiguous()


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked q8 layout of 8-bit codes ``[N, K]`` (int8, or fp8 e4m3fn kept so) with fp32 ``scale``
    ``[N, K/G]``: ``(codes [N/16, K*16], scales fp32 [N/16, K/G*16])``."""
    n, k = codes.shape
    if scale.shape[0] != n or k % scale.shape[1] or (k // scale.shape[1]) % LANES:
        raise ValueError(f"q8 scales {tuple(scale.shape)} do not match codes {tuple(codes.shape)}")
    kept = torch.float8_e4m3fn if codes.dtype == torch.float8_e4m3fn else torch.int8  # (a padded row's bytes: +0.0)
    raw = codes.to(kept).contiguous().view(torch.uint8)  # (moved as bytes)
    packed = _pad_rows(raw).view(-1, LANES, k).transpose(1, 2).contiguous().view(-1, k * LANES).view(kept)
    s = _pad_rows(scale.float()).view(-1, LANES, scale.shape[1]).transpose(1, 2).contiguous()
    return packed, s.view(-1, scale.shape[1] * LANES)


def unpack_q8(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q8`'s inverse: ``(codes [N, K] in their dtype, scale fp32 [N, K/G])``."""
    k, groups = packed.shape[1] // LANES, scales.shape[1] // LANES
    raw = packed.view(torch.uint8) if packed.dtype == torch.float8_e4m3fn else packed
    codes = raw.view(-1, k, LANES).transpose(1, 2).reshape(-1, k)[:n].view(packed.dtype)
    return codes, scales.view(-1, groups, LANES).transpose(1, 2).reshape(-1, groups)[:n]


def available() -> bool:
    """Whether the kernels can run (numba imported)."""
    return HAVE_NUMBA


def _run(kind: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    flat = x.detach().reshape(-1, x.shape[-1])  # no autograd through the kernel (inference only)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    out = torch.empty(flat.shape[0], codes.shape[0] * LANES, dtype=torch.float32)
    compiled()(kind, PRE_NONE, flat.numpy(), _NO_NORM, 0.0, _bytes(codes), scales.numpy(), out.numpy(), 0)
    return out if out.shape[1] == n else out[:, :n].contiguous()


def blocked(weight: torch.Tensor, inputs: int) -> bool:
    """Whether `weight` is a linear of `inputs` inputs in the blocked layout (q4 ``[N/16, K*8]``, q8 ``[N/16, K*16]``),
    not row-major ``[N, K]`` (`Fp8Linear`'s fp8 rows beside a CPU's blocked fp8 codes, `Int8Linear`'s int8 rows)."""
    return weight.shape[1] == inputs * (LANES // 2 if weight.dtype == torch.uint8 else LANES)


def _bytes(codes: torch.Tensor) -> Any:
    """The codes as numpy (fp8 codes as their bytes: numpy has no fp8)."""
    return (codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes).numpy()


def _q8_kind(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """The driver's kind of 8-bit codes (int8 or fp8 e4m3fn) in the blocked layout with their `scales`."""
    group = codes.shape[1] // scales.shape[1]
    if group not in (16, 32):
        raise ValueError(f"q8 groups of {group} inputs: the kernel takes 16 or 32")
    return (1 if group == 32 else 2) + (2 if codes.dtype == torch.float8_e4m3fn else 0)


class Packed:
    """A blocked q4, q8 or f4 weight (`pack_q4` / `pack_q8` / `pack_f4`) as numpy views made once (weights do not change
    after load), called on numpy fp32 inputs with the input formed in the kernel (`PRE_*`): the per-call
    cost of `q4_linear` (the views, the checks) without the tensors. The RMS norm's mean is summed in
    another order than torch's (the last bits may differ, as between BLAS kernels); the rest is the same
    fp32 formula (``weight * (x * rsqrt(mean(x^2) + eps))``, ``silu(g) * u``)."""

    __slots__ = ("codes", "inner", "kind", "n", "scales")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dtype == torch.uint8:  # (4-bit codes: q4's scales and minimums, f4's scales alone)
            self.inner = codes.shape[1] * 2 // LANES
            self.kind = 0 if scales.shape[1] == self.inner else 5
        else:
            self.kind, self.inner = _q8_kind(codes, scales), codes.shape[1] // LANES
        self.codes, self.scales = _bytes(codes.detach().contiguous()), scales.detach().contiguous().numpy()
        self.n = codes.shape[0] * LANES  # every row of the blocks

    def __call__(
        self, x: _F32, out: _F32, pre: int = 0, norm: _F32 | None = None, eps: float = 0.0, add: bool = False
    ) -> None:
        """``out[:, :n] (+)= input @ W.T`` for a C-contiguous fp32 ``x`` (``[M, K]``, ``[M, 2K]`` for
        `PRE_SILU_MUL`) and ``out`` (``[M, n]``)."""
        compiled()(self.kind, pre, x, _NO_NORM if norm is None else norm, eps, self.codes, self.scales, out, int(add))


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[M, N]``) for a 2-D x and a q4 weight in the blocked layout (`pack_q4`) of
    `n` outputs (default: every row of the blocks)."""
    return _run(0, x, codes, scales, codes.shape[0] * LANES if n is None else n)


def f4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[M, N]``) for a 2-D x and an f4 weight in the blocked layout (`pack_f4`)."""
    return _run(5, x, codes, scales, codes.shape[0] * LANES if n is None else n)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[M, N]``) for a 2-D x and a q8 weight in the blocked layout (`pack_q8`): int8 or fp8
    (e4m3fn) codes."""
    return _run(_q8_kind(codes, scales), x, codes, scales, codes.shape[0] * LANES if n is None else n)
