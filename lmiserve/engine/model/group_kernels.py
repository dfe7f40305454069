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
  (``[b, 16 g + l]``), ``w = code * scale``. fp8 bytes are widened exactly through fp16 (`_e4m3_as_f32`), in
  tiles of up to `WIDE_TILE` rows: against fp32 (AMD EPYC Zen4, benchmarks/fp8_cpu.py), decode 1.8-4.8x
  faster, a 128-token prompt chunk 10-20 % slower (fp32's BLAS runs near the FMA peak there).
`pack_q4` / `pack_q8` build it from the natural ``[N, K]`` codes, `unpack_q4` / `unpack_q8` undo it.

The kernel (one call per row block and up to `ROW_TILE` rows of x, fp8 `WIDE_TILE`; blocks split among the threads):
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

import functools
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.jit import HAVE_NUMBA, numba

LANES = 16  # output rows per block (one 512-bit vector of fp32)
Q4_GROUP = 32
ROW_TILE = 4  # rows of x one kernel call accumulates (3-5 vector registers a row; 8 rows spilled)
WIDE_TILE = 8  # fp8's tiles at many rows: one sum a row (its widening costs 4 instructions, shared by the rows)
PRE_NONE, PRE_RMS, PRE_SILU_MUL = 0, 1, 2  # the kernel's input: x, x's RMS norm, silu(gate) * up of x

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
    if k % Q4_GROUP:
        raise ValueError(f"q4 inputs must be a multiple of {Q4_GROUP}, got {k}")
    c = _pad_rows(codes.to(torch.uint8)).view(-1, LANES, k // Q4_GROUP, 2, Q4_GROUP // 2)
    packed = c[..., 0, :] | (c[..., 1, :] << 4)  # [B, 16, G, 16]: byte j of group g
    packed = packed.reshape(-1, LANES, k // 2).transpose(1, 2).contiguous().view(-1, k // 2 * LANES)
    s = torch.stack([_pad_rows(scale.float()), _pad_rows(low.float())], dim=-1)  # [N', G, 2]
    s = s.view(-1, LANES, k // Q4_GROUP, 2).permute(0, 2, 3, 1).contiguous().view(-1, k // Q4_GROUP * 2 * LANES)
    return packed, s


def unpack_q4(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_q4`'s inverse: ``(codes uint8 [N, K], scale fp32 [N, K/32], low fp32 [N, K/32])``."""
    half = packed.shape[1] // LANES
    groups = half * 2 // Q4_GROUP
    b = packed.view(-1, half, LANES).transpose(1, 2).reshape(-1, groups, Q4_GROUP // 2)  # [N', G, 16]
    codes = torch.stack([b & 15, b >> 4], dim=2).reshape(-1, half * 2)[:n]
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


# ---- the kernels ------------------------------------------------------------------------------------
def _e4m3_as_f32(builder: Any, byte: Any) -> Any:  # pragma: no cover - compiled
    """16 fp8 e4m3fn bytes (an i8 vector) as fp32 of 2^-8 times their values, exactly: each byte's sign and 7 other
    bits moved into an fp16's places (fp16's exponent bias is e4m3's plus 8), then widened (F16C's ``vcvtph2ps``;
    subnormals too). e4m3fn's NaN (0x7F, 0xFF), which no checkpoint holds, reads as 480."""
    from llvmlite import ir

    vi16 = ir.VectorType(ir.IntType(16), LANES)
    wide = builder.sext(byte, vi16)  # bits 15..7: the sign; 6..0: exponent and mantissa
    moved = builder.shl(wide, ir.Constant(vi16, [7] * LANES))
    moved = builder.and_(moved, ir.Constant(vi16, [0xBF80 - 0x10000] * LANES))  # the sign's bit 15, bits 13..7
    half = builder.bitcast(moved, ir.VectorType(ir.HalfType(), LANES))
    return builder.fpext(half, ir.VectorType(ir.FloatType(), LANES))


def _tile_intrinsic(kind: str, group: int) -> Any:  # pragma: no cover - compiled
    """An intrinsic ``tile(codes, c_at, scales, s_at, x, xs, m0, out, o_at, n, add, rows)``: one row
    block's 16 outputs for rows ``m0 .. m0 + rows`` (1 to `ROW_TILE`, fp8 `WIDE_TILE`: a switch over compiled tiles)
    of x (``[M, K]`` contiguous; `xs` ``[M, K/32]`` its group sums, q4 only), results to ``out.flat[o_at + (m0 + m)
    * n + l]`` (added to what is there when `add` is nonzero); codes from ``codes.flat[c_at]``, scales from
    ``scales.flat[s_at]``. LLVM IR: a loop over the groups of `group` inputs, unrolled within a group: per input the
    16 codes converted to fp32 once and multiplied into each row's group sums (`chains` independent vectors a row,
    for the FMA latency); per group ``acc += sum * scale (+ min * xs)``."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        rows_v = args[-1]
        exit_block = builder.append_basic_block("tile_end")
        switch = builder.switch(rows_v, exit_block)
        for rows in range(1, (WIDE_TILE if kind == "f8" else ROW_TILE) + 1):
            case = builder.append_basic_block(f"rows{rows}")
            switch.add_case(ir.Constant(rows_v.type, rows), case)
            builder.position_at_end(case)
            emit(context, builder, signature, args, rows)
            builder.branch(exit_block)
        builder.position_at_end(exit_block)
        return context.get_dummy_value()

    def emit(context: Any, builder: Any, signature: Any, args: Any, rows: int) -> None:
        chains = 4 if rows <= 2 else 2 if rows <= ROW_TILE else 1  # independent sums per row (FMA latency at few rows)
        codes_v, c_at, scales_v, s_at, x_v, xs_v, m0, out_v, o_at, n_out, add_v = args[:-1]
        arr = signature.args
        cp = context.make_array(arr[0])(context, builder, codes_v).data
        sp = context.make_array(arr[2])(context, builder, scales_v).data
        xa = context.make_array(arr[4])(context, builder, x_v)
        xp = xa.data
        xsp = context.make_array(arr[5])(context, builder, xs_v).data
        op = context.make_array(arr[7])(context, builder, out_v).data
        inner = builder.extract_value(xa.shape, 1)
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        vi8, vi32, vf = ir.VectorType(ir.IntType(8), LANES), ir.VectorType(i32, LANES), ir.VectorType(f32, LANES)
        zero = ir.Constant(vf, [0.0] * LANES)
        fast = ("contract",)  # fmul + fadd -> FMA; no reassociation (it merged the chains into one)

        def c64(v: int) -> Any:
            return ir.Constant(i64, v)

        def splat(v: Any) -> Any:
            u = builder.insert_element(ir.Constant(vf, ir.Undefined), v, ir.Constant(i32, 0))
            return builder.shuffle_vector(u, ir.Constant(vf, ir.Undefined), ir.Constant(vi32, [0] * LANES))

        def vload(ptr: Any, at: Any, ty: Any, align: int) -> Any:
            return builder.load(builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer()), align=align)

        def fma(a: Any, b: Any, c: Any) -> Any:
            return builder.fadd(builder.fmul(a, b, flags=fast), c, flags=fast)

        groups = builder.sdiv(inner, c64(group))
        entry = builder.block
        loop = builder.append_basic_block("groups")
        done = builder.append_basic_block("done")
        builder.branch(loop)
        builder.position_at_end(loop)
        g = builder.phi(i64)
        g.add_incoming(c64(0), entry)
        phis = [builder.phi(vf) for _ in range(rows)]
        for phi in phis:
            phi.add_incoming(zero, entry)
        k0 = builder.mul(g, c64(group))
        xrows = [builder.add(builder.mul(builder.add(m0, c64(m)), inner), k0) for m in range(rows)]
        sums = [[zero] * chains for _ in range(rows)]
        if kind == "q4":
            sv = vload(sp, builder.add(s_at, builder.mul(g, c64(2 * LANES))), vf, 4)
            lv = vload(sp, builder.add(s_at, builder.add(builder.mul(g, c64(2 * LANES)), c64(LANES))), vf, 4)
            cbase = builder.add(c_at, builder.mul(g, c64(group // 2 * LANES)))
            for j in range(group // 2):
                b = builder.zext(vload(cp, builder.add(cbase, c64(j * LANES)), vi8, 1), vi32)
                lo = builder.uitofp(builder.and_(b, ir.Constant(vi32, [15] * LANES)), vf)
                hi = builder.uitofp(builder.lshr(b, ir.Constant(vi32, [4] * LANES)), vf)
                for m in range(rows):
                    x0 = builder.load(builder.gep(xp, [builder.add(xrows[m], c64(j))]))
                    x1 = builder.load(builder.gep(xp, [builder.add(xrows[m], c64(j + group // 2))]))
                    c = (2 * j) % chains
                    sums[m][c] = fma(lo, splat(x0), sums[m][c])
                    sums[m][c + 1] = fma(hi, splat(x1), sums[m][c + 1])
        else:
            sv = vload(sp, builder.add(s_at, builder.mul(g, c64(LANES))), vf, 4)
            cbase = builder.add(c_at, builder.mul(k0, c64(LANES)))
            if kind == "f8":  # the codes' halves are 2^-8 of their values: the group's scale takes the 2^8
                sv = builder.fmul(sv, ir.Constant(vf, [256.0] * LANES))
            for j in range(group):
                byte = vload(cp, builder.add(cbase, c64(j * LANES)), vi8, 1)
                w = builder.sitofp(byte, vf) if kind == "q8" else _e4m3_as_f32(builder, byte)
                for m in range(rows):
                    xv = builder.load(builder.gep(xp, [builder.add(xrows[m], c64(j))]))
                    sums[m][j % chains] = fma(w, splat(xv), sums[m][j % chains])
        acc = []
        for m in range(rows):
            total = sums[m][0]
            for part in sums[m][1:]:
                total = builder.fadd(total, part, flags=fast)
            a = fma(total, sv, phis[m])
            if kind == "q4":
                xs_at = builder.add(builder.mul(builder.add(m0, c64(m)), groups), g)
                a = fma(lv, splat(builder.load(builder.gep(xsp, [xs_at]))), a)
            acc.append(a)
        body_end = builder.block
        g_next = builder.add(g, c64(1))
        g.add_incoming(g_next, body_end)
        for phi, value in zip(phis, acc):
            phi.add_incoming(value, body_end)
        builder.cbranch(builder.icmp_signed("<", g_next, groups), loop, done)
        builder.position_at_end(done)
        outs = []
        for m in range(rows):
            at = builder.add(o_at, builder.mul(n_out, builder.add(m0, c64(m))))
            outs.append(builder.bitcast(builder.gep(op, [at]), vf.as_pointer()))
        with builder.if_else(builder.icmp_signed("!=", add_v, ir.Constant(add_v.type, 0))) as (added, stored):
            with added:  # the residual add (``x + o``): one fp32 add, as torch's
                for m in range(rows):
                    builder.store(builder.fadd(builder.load(outs[m], align=4), acc[m]), outs[m], align=4)
            with stored:
                for m in range(rows):
                    builder.store(acc[m], outs[m], align=4)

    def typer(typingctx, codes, c_at, scales, s_at, x, xs, m0, out, o_at, n_out, add, rows):  # type: ignore[no-untyped-def]
        return types.void(codes, c_at, scales, s_at, x, xs, m0, out, o_at, n_out, add, rows), codegen

    typer.__name__ = f"{kind}_tile_{group}"
    return intrinsic(typer)


if HAVE_NUMBA:
    _q4_tile = _tile_intrinsic("q4", Q4_GROUP)
    _q8_tile_32 = _tile_intrinsic("q8", 32)
    _q8_tile_16 = _tile_intrinsic("q8", 16)
    _f8_tile_32 = _tile_intrinsic("f8", 32)
    _f8_tile_16 = _tile_intrinsic("f8", 16)


def _driver(
    kind: int, pre: int, x: _F32, norm: _F32, eps: float, codes: Any, scales: _F32, out: _F32, add: int
) -> None:  # pragma: no cover
    """``out[m, 16 b + l]`` (`add` nonzero: ``+=``) for every row block b (split among the threads) and row m of the
    input, in tiles of up to `ROW_TILE` rows (fp8: `WIDE_TILE`). kind 0: q4, 1: q8 with groups of 32, 2: q8 with
    groups of 16, 3 and 4: fp8 codes (e4m3fn bytes) with groups of 32 and 16. The input, formed once per call
    (`PRE_*`): x itself; x's RMS norm with weight `norm` and `eps`; ``silu(gate) * up`` of x ``[M, 2K]``."""
    rows = x.shape[0]
    blocks = codes.shape[0]
    n = blocks * LANES
    inner = codes.shape[1] * 2 // LANES if kind == 0 else codes.shape[1] // LANES
    xin = x
    if pre != PRE_NONE:  # plain loops: an array expression here would be a parallel region of its own
        xin = np.empty((rows, inner), dtype=np.float32)
        one = np.float32(1.0)
        for m in range(rows):
            if pre == PRE_RMS:
                total = np.float32(0.0)
                for k in range(inner):
                    total += x[m, k] * x[m, k]
                r = one / np.sqrt(total / np.float32(inner) + np.float32(eps))
                for k in range(inner):
                    xin[m, k] = norm[k] * (x[m, k] * r)
            else:
                for k in range(inner):
                    g = x[m, k]
                    xin[m, k] = g / (one + np.exp(-g)) * x[m, inner + k]
    groups = inner // Q4_GROUP if kind == 0 else 1
    xs = np.empty((rows, groups), dtype=np.float32)  # q4: the group sums of the input (for the minimums)
    for m in range(rows):
        for g in range(groups):
            total = np.float32(0.0)
            if kind == 0:
                for k in range(g * Q4_GROUP, (g + 1) * Q4_GROUP):
                    total += xin[m, k]
            xs[m, g] = total
    for b in numba.prange(blocks):
        c_at, s_at, m = b * codes.shape[1], b * scales.shape[1], 0
        while m < rows:
            t = min(rows - m, WIDE_TILE if kind >= 3 else ROW_TILE)
            if kind == 0:
                _q4_tile(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            elif kind == 1:
                _q8_tile_32(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            elif kind == 2:
                _q8_tile_16(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            elif kind == 3:
                _f8_tile_32(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            else:
                _f8_tile_16(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            m += t


# sums reassociated (vectorized), no approximate division, square root or exp (the RMS norm and SiLU
# keep torch's fp32 formula; only the order of the mean's sum differs)
_FASTMATH = {"reassoc", "nsz", "contract"}


@functools.cache
def _compiled() -> Any:
    return numba.njit(fastmath=_FASTMATH, parallel=True, cache=True, nogil=True)(_driver)


def available() -> bool:
    """Whether the kernels can run (numba imported)."""
    return HAVE_NUMBA


def _run(kind: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    flat = x.detach().reshape(-1, x.shape[-1])  # no autograd through the kernel (inference only)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    out = torch.empty(flat.shape[0], codes.shape[0] * LANES, dtype=torch.float32)
    _compiled()(kind, PRE_NONE, flat.numpy(), _NO_NORM, 0.0, _bytes(codes), scales.numpy(), out.numpy(), 0)
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
    """A blocked q4 or q8 weight (`pack_q4` / `pack_q8`) as numpy views made once (weights do not change
    after load), called on numpy fp32 inputs with the input formed in the kernel (`PRE_*`): the per-call
    cost of `q4_linear` (the views, the checks) without the tensors. The RMS norm's mean is summed in
    another order than torch's (the last bits may differ, as between BLAS kernels); the rest is the same
    fp32 formula (``weight * (x * rsqrt(mean(x^2) + eps))``, ``silu(g) * u``)."""

    __slots__ = ("codes", "inner", "kind", "n", "scales")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        if codes.dtype == torch.uint8:
            self.kind, self.inner = 0, codes.shape[1] * 2 // LANES
        else:
            self.kind, self.inner = _q8_kind(codes, scales), codes.shape[1] // LANES
        self.codes, self.scales = _bytes(codes.detach().contiguous()), scales.detach().contiguous().numpy()
        self.n = codes.shape[0] * LANES  # every row of the blocks

    def __call__(
        self, x: _F32, out: _F32, pre: int = 0, norm: _F32 | None = None, eps: float = 0.0, add: bool = False
    ) -> None:
        """``out[:, :n] (+)= input @ W.T`` for a C-contiguous fp32 ``x`` (``[M, K]``, ``[M, 2K]`` for
        `PRE_SILU_MUL`) and ``out`` (``[M, n]``)."""
        _compiled()(self.kind, pre, x, _NO_NORM if norm is None else norm, eps, self.codes, self.scales, out, int(add))


def q4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[M, N]``) for a 2-D x and a q4 weight in the blocked layout (`pack_q4`) of
    `n` outputs (default: every row of the blocks)."""
    return _run(0, x, codes, scales, codes.shape[0] * LANES if n is None else n)


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``x @ W.T`` (fp32 ``[M, N]``) for a 2-D x and a q8 weight in the blocked layout (`pack_q8`): int8 or fp8
    (e4m3fn) codes."""
    return _run(_q8_kind(codes, scales), x, codes, scales, codes.shape[0] * LANES if n is None else n)
