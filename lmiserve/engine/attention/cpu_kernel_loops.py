"""The compiled loops of the CPU attention (attention/cpu_kernel.py: what they compute, their API and measurements):
`_kernel` (a task a row or a part of its kv heads) and `_head_kernel` (a task a row's kv head), the softmax they
inline, and how they read a cache's values: an fp32 cache's as they are, a bf16 cache's as its bits (numba has no
bf16), an fp8 cache's as its bytes (e4m3 typed uint8, e5m2 int8: the type picks the format), each widened exactly to
fp32 where it is read (`widened`), an fp8 block's head once for all the query groups that read it (`widened_block`,
`at`). One file: numba's on-disk cache of a kernel is keyed by its source file, so what a kernel inlines lives beside
it (a widening changed in another file would leave a stale compiled kernel in the cache)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from lmiserve.engine.jit import lazily_compiled, numba

_F32 = npt.NDArray[np.float32]
_I64 = npt.NDArray[np.int64]


def softmax_rows(scores: _F32) -> None:  # pragma: no cover - compiled
    """Each row of `scores` (``[groups, span]``) into its softmax, in place (max-subtracted, fp32); the
    kernels below call it compiled and inlined."""
    groups, span = scores.shape
    for g in range(groups):
        top = scores[g, 0]
        for j in range(1, span):
            if scores[g, j] > top:
                top = scores[g, j]
        total = np.float32(0.0)
        for j in range(span):
            e = np.float32(math.exp(scores[g, j] - top))
            scores[g, j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(span):
            scores[g, j] *= inv


def widened(value: np.float32) -> np.float32:  # pragma: no cover - compiled
    """A cache's value as fp32: an fp32 cache's as it is; a bf16 cache's, held as its 16 bits (uint16), moved to
    the top of an fp32's bits (exact: bf16 is fp32 cut to its top 16 bits); an fp8 cache's byte (e4m3 held as
    uint8, e5m2 as int8: the type picks the format) widened by its bits. Compiled per cache dtype (below)."""
    return value


def widened_block(cache: Any, block: int, head: int, buffer: _F32, count: int) -> Any:  # pragma: no cover
    """Where the kernels read head `head` of cache block `block` (`at`), each value widened as read (`widened`):
    an fp8 cache's first `count` positions widened into `buffer` (fp32) at once, for all the query groups that
    read them (its widening costs ~10 instructions; once a group, it took e4m3's decode to 1.5x); any other cache
    read in place (fp32's needs nothing; bf16's one shift, cheaper redone than stored and loaded again: measured).
    Compiled per cache dtype (below), as `at`; no view made, so no reference counted a block."""
    return cache


def at(source: Any, block: int, head: int, o: int, d: int) -> Any:  # pragma: no cover - compiled
    """Position `o`, element `d` of what `widened_block` gave: its buffer's, or the cache's own."""
    return source[block, head, o, d]


if numba is not None:  # compiled with the first kernel that calls it
    softmax_rows = numba.njit(inline="always", fastmath=True, cache=True, nogil=True)(softmax_rows)

    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    @_intrinsic
    def _bf16_bits_as_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
        if bits != _types.uint16:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            from llvmlite import ir

            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return _types.float32(bits), codegen

    @_intrinsic
    def _fp8_bits_as_f32(typingctx: Any, bits: Any) -> Any:  # pragma: no cover - compiled
        """An fp8 byte as fp32, exactly and without a branch (so the loops stay vectorized): its exponent and
        mantissa bits moved into an fp32's low exponent field and multiplied by 2**(127 - bias), which makes
        subnormals right too; the sign put back; e4m3fn's NaN (0x7f) and e5m2's infinities and NaNs (exponent
        all ones) selected apart. e4m3 comes typed uint8, e5m2 int8 (`cpu_kernel.bits`). (A process in
        flush-denormal mode, which lmiserve never sets, would read the subnormal ones as zero.)"""
        if bits not in (_types.uint8, _types.int8):
            return None
        e4m3 = bits == _types.uint8
        shift, bias, special = (20, 7, 0x7F) if e4m3 else (21, 15, 0x7C)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            from llvmlite import ir

            i32, f32 = ir.IntType(32), ir.FloatType()

            def const(value: int) -> Any:
                return ir.Constant(i32, value)

            byte = builder.zext(args[0], i32)
            magnitude = builder.and_(byte, const(0x7F))
            shifted = builder.bitcast(builder.shl(magnitude, const(shift)), f32)
            scaled = builder.fmul(shifted, ir.Constant(f32, 2.0 ** (127 - bias)))
            sign = builder.shl(builder.and_(byte, const(0x80)), const(24))
            finite = builder.or_(builder.bitcast(scaled, i32), sign)
            if e4m3:  # 0x7f and 0xff: NaN
                is_special = builder.icmp_unsigned("==", magnitude, const(special))
                other = builder.or_(sign, const(0x7FC00000))
            else:  # exponent 31: infinity (mantissa 0) or NaN
                is_special = builder.icmp_unsigned(">=", magnitude, const(special))
                other = builder.or_(
                    sign, builder.or_(const(0x7F800000), builder.shl(builder.and_(byte, const(3)), const(21)))
                )
            return builder.bitcast(builder.select(is_special, other, finite), f32)

        return _types.float32(bits), codegen

    @_overload(widened, inline="always")
    def _widened(value):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled (numba: no annotations)
        if value == _types.uint16:
            return lambda value: _bf16_bits_as_f32(value)  # type: ignore[call-arg]
        if value in (_types.uint8, _types.int8):
            return lambda value: _fp8_bits_as_f32(value)  # type: ignore[call-arg]
        if isinstance(value, _types.Float):
            return lambda value: value
        return None

    @_overload(widened_block, inline="always")
    def _widened_block(cache, block, head, buffer, count):  # type: ignore[no-untyped-def]  # pragma: no cover
        if cache.dtype not in (_types.uint8, _types.int8):
            return lambda cache, block, head, buffer, count: cache

        def widen(cache, block, head, buffer, count):  # type: ignore[no-untyped-def]
            for o in range(count):
                for d in range(cache.shape[3]):
                    buffer[o, d] = widened(cache[block, head, o, d])
            return buffer

        return widen

    @_overload(at, inline="always")
    def _at(source, block, head, o, d):  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
        if source.ndim == 2:
            return lambda source, block, head, o, d: source[o, d]
        return lambda source, block, head, o, d: source[block, head, o, d]


def _kernel(  # pragma: no cover - compiled
    query: _F32,
    key_cache: _F32,
    value_cache: _F32,
    new_keys: _F32,
    new_values: _F32,
    block_tables: _I64,
    spans: _I64,
    scale: np.float32,
    window: int,
    parts: int,
    out: _F32,
) -> None:
    """One task per (row, part): part ``i`` of `parts` takes kv heads ``[i * kv_heads // parts, (i + 1) *
    kv_heads // parts)``. With ``parts == 1`` a task reads each block of its row whole (all its heads'
    keys, then values: ``kv_heads * block_size * head_dim`` contiguous values), which memory streams
    better than one head's ``block_size * head_dim`` at a time; with few rows, more parts keep every
    thread busy. `window` > 0: a row attends over its last `window` positions only (engine/attention/windows.py)."""
    rows, kv_heads, groups, dim = query.shape
    block_size = key_cache.shape[2]
    for task in numba.prange(rows * parts):
        row = task // parts
        part = task % parts
        first = part * kv_heads // parts
        heads = (part + 1) * kv_heads // parts - first
        span = spans[row]
        last = span - 1
        last_block = block_tables[row, last // block_size]
        last_offset = last % block_size
        for h in range(heads):
            for d in range(dim):
                key_cache[last_block, first + h, last_offset, d] = new_keys[row, first + h, d]
                value_cache[last_block, first + h, last_offset, d] = new_values[row, first + h, d]
        blocks = (span + block_size - 1) // block_size
        lo = span - window if window > 0 and window < span else 0  # the first position the row sees
        q = query[row]
        scores = np.empty((heads, groups, span - lo), dtype=np.float32)
        buffer = np.empty((block_size, dim), dtype=np.float32)  # an fp8 block's head widened
        for b in range(lo // block_size, blocks):
            block = block_tables[row, b]
            base = b * block_size
            count = min(block_size, span - base)
            for h in range(heads):
                head = first + h
                keys = widened_block(key_cache, block, head, buffer, count)
                for o in range(max(0, lo - base), count):
                    for g in range(groups):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += q[head, g, d] * widened(at(keys, block, head, o, d))
                        scores[h, g, base + o - lo] = acc * scale
        for h in range(heads):
            softmax_rows(scores[h])
        # each value block read once for all groups, into a local accumulator
        acc_out = np.zeros((heads, groups, dim), dtype=np.float32)
        for b in range(lo // block_size, blocks):
            block = block_tables[row, b]
            base = b * block_size
            count = min(block_size, span - base)
            for h in range(heads):
                head = first + h
                values = widened_block(value_cache, block, head, buffer, count)
                for o in range(max(0, lo - base), count):
                    for g in range(groups):
                        p = scores[h, g, base + o - lo]
                        for d in range(dim):
                            acc_out[h, g, d] += p * widened(at(values, block, head, o, d))
        for h in range(heads):
            for g in range(groups):
                for d in range(dim):
                    out[row, first + h, g, d] = acc_out[h, g, d]


def _head_kernel(  # pragma: no cover - compiled
    query: _F32,
    key_cache: _F32,
    value_cache: _F32,
    new_keys: _F32,
    new_values: _F32,
    block_tables: _I64,
    spans: _I64,
    scale: np.float32,
    window: int,
    out: _F32,
) -> None:
    """`_kernel` with one task per (row, kv head), the layout few rows take (``parts == kv_heads``):
    the same arithmetic in the same order, addressed per head, with the output accumulated in place
    (no per-task accumulator), which at one row and a short context is a tenth of the kernel's time."""
    rows, kv_heads, groups, dim = query.shape
    block_size = key_cache.shape[2]
    for task in numba.prange(rows * kv_heads):
        row = task // kv_heads
        head = task % kv_heads
        span = spans[row]
        last = span - 1
        last_block = block_tables[row, last // block_size]
        last_offset = last % block_size
        for d in range(dim):
            key_cache[last_block, head, last_offset, d] = new_keys[row, head, d]
            value_cache[last_block, head, last_offset, d] = new_values[row, head, d]
        blocks = (span + block_size - 1) // block_size
        lo = span - window if window > 0 and window < span else 0  # the first position the row sees
        scores = np.empty((groups, span - lo), dtype=np.float32)
        buffer = np.empty((block_size, dim), dtype=np.float32)  # an fp8 block's head widened
        for b in range(lo // block_size, blocks):
            base = b * block_size
            count = min(block_size, span - base)
            block = block_tables[row, b]
            keys = widened_block(key_cache, block, head, buffer, count)
            for o in range(max(0, lo - base), count):
                for g in range(groups):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += query[row, head, g, d] * widened(at(keys, block, head, o, d))
                    scores[g, base + o - lo] = acc * scale
        softmax_rows(scores)
        for g in range(groups):
            for d in range(dim):
                out[row, head, g, d] = 0.0
        for b in range(lo // block_size, blocks):
            base = b * block_size
            count = min(block_size, span - base)
            block = block_tables[row, b]
            values = widened_block(value_cache, block, head, buffer, count)
            for o in range(max(0, lo - base), count):
                for g in range(groups):
                    p = scores[g, base + o - lo]
                    for d in range(dim):
                        out[row, head, g, d] += p * widened(at(values, block, head, o, d))


# each compiled on its first call: ``compiled_kernel()(query, key_cache, value_cache, new_keys, new_values, tables,
# spans, scale, window, parts, out)`` on numpy arrays (`cpu_kernel.kernel_decode_attention`'s), the head kernel's
# the same without `parts`
compiled_kernel = lazily_compiled(_kernel)
compiled_head_kernel = lazily_compiled(_head_kernel)
