"""The compiled CPU attention (numba; an fp32, bf16 or fp8 cache, fp32 arithmetic): each row's new key and value
written through its block table, then its query heads attend over exactly its own positions (the last
`window` of them in a sliding-window layer), reading the blocks in place.

Why: in a decode step every row has one query token per head and its own context length. As torch ops
that is batched matmuls over the longest row's span (padding included), masking and a softmax: ~20 ops a
layer that read the cache at about half the memory bandwidth. These kernels read each row's keys and
values once, for its own length only, in one call a layer. The CPU attention backend
(attention/backends.py) runs its decode rows and short prompt chunks through them.

CPU caches of fp32, bf16 or fp8 (`CACHE_DTYPES`); `available(...)` says when they apply, and the torch ops
(attention/paged.py) serve everything else (an fp16 cache). A bf16 cache is read as its bits (numba has no bf16) and
widened exactly; an fp8 one as its bytes, widened exactly by their bits too (`widened`); the query, scores, softmax
and sums are fp32 in each, and the output is rounded to the query's dtype once. An fp8 cache's layer scales
(attention/kv_quant.py): the key's folded into the scores' scale, the value's on the output. Numerics: fp32
accumulation in another order than BLAS, so results differ from the torch path in the last bits, as two BLAS kernels
do (and a bf16 model's torch path rounds its products to bf16).

Speed (benchmarks/paged_attention.py: 32 rows of spans 70..591, SmolLM2-135M's 3 kv heads x 3 groups x
64, blocks scattered at random; a shared 2-vCPU AMD EPYC): 2.5-2.8 ms a layer on one thread with
block_size 16, ~1.15x faster with block_size 64. The cost is per discontinuity of the stream (~100 ns a
block jump), not the indirection; reading a row's blocks whole (all its kv heads, `_kernel`'s
``parts == 1``) took ~10-20 % off. Over a bf16 cache (2026-12-07, 2 threads, fastest of 200 calls): 1.27 ms
against 1.42 over fp32 and 4.20 with torch's bf16 ops; at one row 0.11, 0.14 and 0.36 ms. Over an fp8 cache
(2026-12-07, fastest of 200): 1.0-1.15x the fp32 cache's time (its bytes looked up in a table instead: 1.75-2x),
against 3.5-9x with torch's ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.attention import kv_quant
from lmiserve.engine.jit import HAVE_NUMBA, lazily_compiled, numba

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
        all ones) selected apart. e4m3 comes typed uint8, e5m2 int8 (`bits`). (A process in flush-denormal mode,
        which lmiserve never sets, would read the subnormal ones as zero.)"""
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
        for b in range(lo // block_size, blocks):
            keys = key_cache[block_tables[row, b]]  # [kv_heads, block_size, dim] view: simpler addressing
            base = b * block_size
            count = min(block_size, span - base)
            for h in range(heads):
                head = first + h
                for o in range(max(0, lo - base), count):
                    for g in range(groups):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += q[head, g, d] * widened(keys[head, o, d])
                        scores[h, g, base + o - lo] = acc * scale
        for h in range(heads):
            softmax_rows(scores[h])
        # each value block read once for all groups, into a local accumulator
        acc_out = np.zeros((heads, groups, dim), dtype=np.float32)
        for b in range(lo // block_size, blocks):
            values = value_cache[block_tables[row, b]]
            base = b * block_size
            count = min(block_size, span - base)
            for h in range(heads):
                head = first + h
                for o in range(max(0, lo - base), count):
                    for g in range(groups):
                        p = scores[h, g, base + o - lo]
                        for d in range(dim):
                            acc_out[h, g, d] += p * widened(values[head, o, d])
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
        for b in range(lo // block_size, blocks):
            block = block_tables[row, b]
            base = b * block_size
            count = min(block_size, span - base)
            for o in range(max(0, lo - base), count):
                for g in range(groups):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        acc += query[row, head, g, d] * widened(key_cache[block, head, o, d])
                    scores[g, base + o - lo] = acc * scale
        softmax_rows(scores)
        for g in range(groups):
            for d in range(dim):
                out[row, head, g, d] = 0.0
        for b in range(lo // block_size, blocks):
            block = block_tables[row, b]
            base = b * block_size
            count = min(block_size, span - base)
            for o in range(max(0, lo - base), count):
                for g in range(groups):
                    p = scores[g, base + o - lo]
                    for d in range(dim):
                        out[row, head, g, d] += p * widened(value_cache[block, head, o, d])


_compiled_kernel = lazily_compiled(_kernel)
_compiled_head_kernel = lazily_compiled(_head_kernel)


def compiled_head_kernel() -> Callable[..., None]:
    """`_head_kernel` compiled: ``(query, key_cache, value_cache, new_keys, new_values, tables, spans,
    scale, window, out)`` on numpy arrays (`kernel_decode_attention`'s, made by its caller)."""
    return _compiled_head_kernel()


# the caches the kernels read (queries and sums in fp32)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the compiled kernels serve a KV cache of this dtype on this device (numba, fp32, bf16 or fp8, CPU)."""
    return HAVE_NUMBA and device.type == "cpu" and dtype in CACHE_DTYPES


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile the kernels for a cache of `dtype` (a few seconds; later processes load them from numba's cache)."""
    cache = torch.zeros(2, 2, 2, 8, dtype=dtype)
    for parts in (1, 2):  # whole rows (`_kernel`), a task a kv head (`_head_kernel`)
        compiled_decode_attention(
            torch.zeros(1, 2, 1, 8),
            cache,
            cache.clone(),
            torch.zeros(1, 2, 8, dtype=dtype),
            torch.zeros(1, 2, 8, dtype=dtype),
            torch.tensor([[1]]),
            np.array([2], dtype=np.int64),
            1.0,
            parts,
        )


def _host_spans(spans: npt.ArrayLike) -> _I64:
    return np.ascontiguousarray(spans, dtype=np.int64)


class KernelRows(NamedTuple):
    """The compiled kernel's per-step arguments, made once for every layer of a step: the rows' block
    tables and spans as host arrays and the tasks per row (`_parts`)."""

    tables: _I64
    spans: _I64
    parts: int

    @classmethod
    def of(cls, block_tables: torch.Tensor, spans: npt.ArrayLike, kv_heads: int) -> KernelRows:
        tables = np.ascontiguousarray(block_tables.to(torch.int64).numpy())
        return cls(tables, _host_spans(spans), _parts(tables.shape[0], kv_heads))


def kernel_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    rows: KernelRows,
    scale: float,
    window: int | None = None,
    scales: tuple[float, float] = kv_quant.UNIT,
) -> torch.Tensor:
    """`compiled_decode_attention` with the step's host arguments made once (`KernelRows`): a task a
    (row, kv head) through `_head_kernel`, else `rows.parts` tasks a row through `_kernel`. A bf16 or fp8 cache:
    the new keys and values are stored as it stores them (`kv_quant.quantize`, an fp8 one's over the layer's
    `scales`), the query widened to fp32 and the output rounded to its dtype; an fp8 cache's key scale is folded
    into `scale`, its value scale multiplies the output."""
    out = torch.empty(query.shape, dtype=torch.float32)
    kv_dtype = key_cache.dtype
    fp8 = kv_quant.is_fp8(kv_dtype)
    arrays = (
        query.to(torch.float32).contiguous().numpy(),
        bits(key_cache),
        bits(value_cache),
        stored_bits(new_keys, kv_dtype, scales[0]),
        stored_bits(new_values, kv_dtype, scales[1]),
        rows.tables,
        rows.spans,
        np.float32(scale * scales[0] if fp8 else scale),
        window or 0,
    )
    if rows.parts == query.shape[1]:
        _compiled_head_kernel()(*arrays, out.numpy())
    else:
        _compiled_kernel()(*arrays, rows.parts, out.numpy())
    if fp8 and scales[1] != 1.0:
        out.mul_(scales[1])
    return out.to(query.dtype)


_VIEWS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.int8}


def bits(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A cache-dtype tensor as the kernels read it (`widened`): fp32 as it is, bf16 as its bits (uint16), e4m3
    as its bytes (uint8), e5m2 as its bytes typed int8."""
    view = _VIEWS.get(tensor.dtype)
    return (tensor if view is None else tensor.view(view)).numpy()


def stored_bits(new: torch.Tensor, kv_dtype: torch.dtype, scale: float) -> npt.NDArray[Any]:
    """New keys or values as a pool of `kv_dtype` stores them (`kv_quant.quantize` over the layer's `scale`), as
    the kernels read them (`bits`)."""
    return bits(kv_quant.quantize(new, kv_dtype, scale).contiguous())


def compiled_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    block_tables: torch.Tensor,
    spans: npt.ArrayLike,
    scale: float,
    parts: int | None = None,
    window: int | None = None,
    scales: tuple[float, float] = kv_quant.UNIT,
) -> torch.Tensor:
    """`paged_decode_attention` as one numba kernel: CPU tensors, caches fp32, bf16 or fp8 (with the layer's
    `scales`) and contiguous. `parts`: tasks per row (1: whole rows, ``kv_heads``: one head each; default by the
    row count, see `_kernel`)."""
    rows = KernelRows.of(block_tables, spans, query.shape[1])
    if parts is not None:
        rows = rows._replace(parts=parts)
    return kernel_decode_attention(query, key_cache, value_cache, new_keys, new_values, rows, scale, window, scales)


def _parts(rows: int, kv_heads: int) -> int:
    """Whole rows per task while there are at least 4 rows a thread, else one kv head per task."""
    return 1 if rows >= 4 * numba.get_num_threads() else kv_heads
