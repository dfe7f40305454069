"""The compiled CPU attention (numba; an fp32, bf16 or fp8 cache, fp32 arithmetic): each row's new key and value
written through its block table, then its query heads attend over exactly its own positions (the last
`window` of them in a sliding-window layer), reading the blocks in place.

Why: in a decode step every row has one query token per head and its own context length. As torch ops
that is batched matmuls over the longest row's span (padding included), masking and a softmax: ~20 ops a
layer that read the cache at about half the memory bandwidth. These kernels read each row's keys and
values once, for its own length only, in one call a layer. The CPU attention backend
(attention/backends.py) runs its decode rows and short prompt chunks through them.

The loops themselves, and how they read each cache dtype, are in attention/cpu_kernel_loops.py. CPU caches of fp32,
bf16 or fp8 (`CACHE_DTYPES`); `available(...)` says when they apply, and the torch ops
(attention/paged.py) serve everything else (an fp16 cache). A bf16 cache is read as its bits (numba has no bf16) and
widened exactly; an fp8 one as its bytes, widened exactly by their bits too, a block's head once for all the query
groups that read it; the query, scores, softmax
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
against 3.5-9x with torch's ops. At 16 rows of 2,048 positions (medians of 40 calls, two runs), e4m3 took 1.7-1.9x
fp32's time and e5m2 1.4x while each byte was widened once a query group; once a block's head, 1.0-1.2x both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from lmiserve.engine.attention import kv_quant
from lmiserve.engine.attention.cpu_kernel_loops import compiled_head_kernel, compiled_kernel
from lmiserve.engine.jit import HAVE_NUMBA, numba

_F32 = npt.NDArray[np.float32]
_I64 = npt.NDArray[np.int64]


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
        compiled_head_kernel()(*arrays, out.numpy())
    else:
        compiled_kernel()(*arrays, rows.parts, out.numpy())
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
