"""The compiled part of the CPU's group kernels (`group_kernels`: their layouts, API and measurements): the tiles, LLVM
IR built by numba intrinsics for one row block of 16 outputs over a few rows of the input, per format (4-bit codes
with a scale and a minimum a group, ``q4``; 8-bit integer codes, ``q8``; fp8 e4m3fn bytes, ``f8``; 4-bit e2m1 floats,
MXFP4's values, ``f4``; each with a scale a group), and the parallel driver over the row blocks that calls them
(`compiled`). One file: numba's on-disk cache of the driver is keyed by its source file, so the tiles it inlines live
beside it (a tile changed in another file would leave a stale compiled driver in the cache)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt

from lmiserve.engine.jit import HAVE_NUMBA, numba

__all__ = ["LANES", "PRE_NONE", "PRE_RMS", "PRE_SILU_MUL", "Q4_GROUP", "ROW_TILE", "WIDE_TILE", "compiled"]

LANES = 16  # output rows per block (one 512-bit vector of fp32)
Q4_GROUP = 32
ROW_TILE = 4  # rows of x one kernel call accumulates (3-5 vector registers a row; 8 rows spilled)
WIDE_TILE = 8  # fp8's and fp4's tiles at many rows: one sum a row (their widening is shared by the rows)
PRE_NONE, PRE_RMS, PRE_SILU_MUL = 0, 1, 2  # the kernel's input: x, x's RMS norm, silu(gate) * up of x

_F32 = npt.NDArray[np.float32]


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


def _e2m1_as_f32(builder: Any, byte: Any, shift: int) -> Any:  # pragma: no cover - compiled
    """16 e2m1 codes (4-bit floats: sign, 2 exponent bits, 1 mantissa bit), the low (`shift` 12) or high (8) nibbles
    of 16 bytes (an i16 vector, zero-extended), as fp32 of 2^-14 times their values, exactly: the nibble shifted to
    an fp16's top bits, then arithmetically down by 3 and masked, so the sign stays at bit 15 and exponent and mantissa
    land at bits 11..9 (an fp16 of exponent e is 2^-14 times e2m1's, its subnormal 0.5 too); then widened (F16C's
    ``vcvtph2ps``)."""
    from llvmlite import ir

    vi16 = ir.VectorType(ir.IntType(16), LANES)
    top = builder.shl(byte, ir.Constant(vi16, [shift] * LANES))
    moved = builder.and_(
        builder.ashr(top, ir.Constant(vi16, [3] * LANES)), ir.Constant(vi16, [0x8E00 - 0x10000] * LANES)
    )
    return builder.fpext(
        builder.bitcast(moved, ir.VectorType(ir.HalfType(), LANES)), ir.VectorType(ir.FloatType(), LANES)
    )


def tile_intrinsic(kind: str, group: int) -> Any:  # pragma: no cover - compiled
    """An intrinsic ``tile(codes, c_at, scales, s_at, x, xs, m0, out, o_at, n, add, rows)`` of the format `kind`
    (``q4``, ``q8``, ``f8``, ``f4``): one row block's 16 outputs for rows ``m0 .. m0 + rows`` (1 to `ROW_TILE`, fp8
    and fp4 `WIDE_TILE`: a switch over compiled tiles) of x (``[M, K]`` contiguous; `xs` ``[M, K/32]`` its group sums,
    q4 only), results to ``out.flat[o_at + (m0 + m) * n + l]`` (added to what is there when `add` is nonzero); codes
    from ``codes.flat[c_at]``, scales from ``scales.flat[s_at]``. LLVM IR: a loop over the groups of `group` inputs,
    unrolled within a group: per input the 16 codes converted to fp32 once and multiplied into each row's group sums
    (`chains` independent vectors a row, for the FMA latency); per group ``acc += sum * scale (+ min * xs)``."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        rows_v = args[-1]
        exit_block = builder.append_basic_block("tile_end")
        switch = builder.switch(rows_v, exit_block)
        for rows in range(1, (WIDE_TILE if kind in ("f8", "f4") else ROW_TILE) + 1):
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

        def nibbles(byte: Any) -> tuple[Any, Any]:  # 16 bytes' low and high codes as fp32 (q4's and f4's)
            if kind == "f4":
                wide = builder.zext(byte, ir.VectorType(ir.IntType(16), LANES))
                return _e2m1_as_f32(builder, wide, 12), _e2m1_as_f32(builder, wide, 8)
            wide = builder.zext(byte, vi32)
            low = builder.uitofp(builder.and_(wide, ir.Constant(vi32, [15] * LANES)), vf)
            return low, builder.uitofp(builder.lshr(wide, ir.Constant(vi32, [4] * LANES)), vf)

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
        if kind in ("q4", "f4"):  # two codes a byte: inputs 32 g + j (the low nibble) and 32 g + 16 + j (the high)
            stride = 2 * LANES if kind == "q4" else LANES  # (q4: a scale and a minimum a group)
            sv = vload(sp, builder.add(s_at, builder.mul(g, c64(stride))), vf, 4)
            if kind == "q4":
                lv = vload(sp, builder.add(s_at, builder.add(builder.mul(g, c64(stride)), c64(LANES))), vf, 4)
            else:  # the values are 2^-14 of e2m1's: the group's scale takes the 2^14
                sv = builder.fmul(sv, ir.Constant(vf, [16384.0] * LANES))
            cbase = builder.add(c_at, builder.mul(g, c64(group // 2 * LANES)))
            for j in range(group // 2):
                byte = vload(cp, builder.add(cbase, c64(j * LANES)), vi8, 1)
                lo, hi = nibbles(byte)
                for m in range(rows):
                    x0 = builder.load(builder.gep(xp, [builder.add(xrows[m], c64(j))]))
                    x1 = builder.load(builder.gep(xp, [builder.add(xrows[m], c64(j + group // 2))]))
                    sums[m][(2 * j) % chains] = fma(lo, splat(x0), sums[m][(2 * j) % chains])
                    sums[m][(2 * j + 1) % chains] = fma(hi, splat(x1), sums[m][(2 * j + 1) % chains])
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
    _q4_tile = tile_intrinsic("q4", Q4_GROUP)
    _q8_tile_32 = tile_intrinsic("q8", 32)
    _q8_tile_16 = tile_intrinsic("q8", 16)
    _f8_tile_32 = tile_intrinsic("f8", 32)
    _f8_tile_16 = tile_intrinsic("f8", 16)
    _f4_tile = tile_intrinsic("f4", Q4_GROUP)


def _driver(
    kind: int, pre: int, x: _F32, norm: _F32, eps: float, codes: Any, scales: _F32, out: _F32, add: int
) -> None:  # pragma: no cover
    """``out[m, 16 b + l]`` (`add` nonzero: ``+=``) for every row block b (split among the threads) and row m of the
    input, in tiles of up to `ROW_TILE` rows (fp8, fp4: `WIDE_TILE`). kind 0: q4, 1: q8 with groups of 32, 2: q8 with
    groups of 16, 3 and 4: fp8 codes (e4m3fn bytes) with groups of 32 and 16, 5: f4. The input, formed once per call
    (`PRE_*`): x itself; x's RMS norm with weight `norm` and `eps`; ``silu(gate) * up`` of x ``[M, 2K]``."""
    rows = x.shape[0]
    blocks = codes.shape[0]
    n = blocks * LANES
    inner = codes.shape[1] * 2 // LANES if kind in (0, 5) else codes.shape[1] // LANES
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
            elif kind == 4:
                _f8_tile_16(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            else:
                _f4_tile(codes, c_at, scales, s_at, xin, xs, m, out, b * LANES, n, add, t)
            m += t


# sums reassociated (vectorized), no approximate division, square root or exp (the RMS norm and SiLU
# keep torch's fp32 formula; only the order of the mean's sum differs)
_FASTMATH = {"reassoc", "nsz", "contract"}


@functools.cache
def compiled() -> Any:
    return numba.njit(fastmath=_FASTMATH, parallel=True, cache=True, nogil=True)(_driver)
