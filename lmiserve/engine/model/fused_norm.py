"""A decode step's element-wise work in fewer kernels on CUDA (issue #39): the residual add with the next
RMS norm in one Triton kernel a row (`add_rms_norm`), SiLU with the product of the gate and up halves in
one (`silu_mul`), the rotary embedding of q's and k's heads in one (`rope`), which over the Triton attention also
stores the step's keys and values in the layer's paged cache (`rope_store`: the backend's `store_target`), and
norms each q and k head first where the model does (Qwen3's).

Why: on an H200 the 8B shape's step at one stream spent 1.5-1.9 ms of its 5.6-6.1 ms outside the matrix
products (benchmarks/README.md, "The GPU check on an NVIDIA H200"): `FastLlama._layers` runs about 27
small kernels a layer (an RMS norm is eight: the cast, square, mean, add, rsqrt, product, cast back and the
weight), each a few microseconds even replayed from a CUDA graph. With these kernels a layer runs about 17
fewer (two norms with their adds: 2 kernels instead of 18; SiLU and the product: 1 instead of 2; the
rotary embedding: 1 instead of 4, the half-swap's concatenation, two products and their sum; with the cache's
write, 1 instead of 8: the Triton backend's write copies the keys and the values out of the q/k/v rows and
``index_copy_``s each, four kernels more).

The arithmetic is transformers' (LlamaRMSNorm: fp32 statistics, the normalized row rounded to the model's
dtype, then the weight; the residual add and SiLU rounded to the model's dtype where eager rounds them);
only the order of the sum of squares differs, so bf16 results can differ by a rounding.

Where a model's fused q/k/v products are fp8 on a GPU with fp8 products (`fp8_rows_for`), the norm's kernel also
writes each normed row of a decode step in fp8 (over its own range, as `fp8_w8a8` quantizes it) and gives it to
`fp8_w8a8` (`fp8_w8a8.given_rows`), and so does SiLU's kernel: the q/k/v, gate/up and down products that read
those rows then skip their own quantizing kernel (one kernel fewer each, a layer's three of its four; 96 a step
of the 8B shape). In a decode graph's step over the Triton attention the attention's kernel writes its output's
rows in fp8 too (`attend`), for o's product: all four, 128 a step.

Whether a model's steps run them is measured on the serving GPU when its forward is built
(engine/model/fused_choice.py), unless ``LMISERVE_FUSED_ELEMENTWISE`` is ``1`` (on) or ``0`` (off): `USE_ON_CUDA`.
The tests run the kernels under Triton's interpreter on CPU tensors (`FastLlama.fused_elementwise`), against the
unfused forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.attention import kv_quant
from lmiserve.engine.attention.backend_base import AttentionBackend, KvStore
from lmiserve.engine.model import fp8_w8a8, kernel_choice
from lmiserve.engine.model.layout_variants import NormWeight

try:
    import triton
except ImportError:  # pragma: no cover - triton ships with CUDA torch wheels
    triton = None

# True: on CUDA; False: never; None: where `fused_choice.measure` finds them faster on the serving GPU
USE_ON_CUDA = kernel_choice.switch("LMISERVE_FUSED_ELEMENTWISE")

__all__ = [
    "USE_ON_CUDA",
    "add_rms_norm",
    "attend",
    "available",
    "fp8_rows_for",
    "rope",
    "rope_store",
    "silu_mul",
    "stores_in",
    "wanted",
]

SILU_BLOCK = 1024


def available() -> bool:
    return triton is not None


def wanted(device: torch.device) -> bool:
    """Whether the fast forward on `device` may run these kernels: CUDA with Triton, `USE_ON_CUDA` not off (then
    `fused_choice.chosen` says whether it does)."""
    return USE_ON_CUDA is not False and device.type == "cuda" and available()


@functools.cache
def _kernels() -> Any:
    from lmiserve.engine.model import fused_norm_kernel

    return (
        triton.jit(fused_norm_kernel.add_rms_norm_kernel),
        triton.jit(fused_norm_kernel.silu_mul_kernel),
        triton.jit(fused_norm_kernel.rope_store_kernel),
    )


def fp8_rows_for(layers: Any, device: torch.device) -> bool:
    """Whether `add_rms_norm` writes its decode rows in fp8 too for `layers` (`FastLlama`'s fused layers) on
    `device`: a GPU with fp8 products (a CPU under the tests' interpreter), every layer's q/k/v one fp8 product."""
    fp8 = torch.float8_e4m3fn
    return fp8_devices.native(device) and all(len(g.qkv) == 1 and g.qkv[0].weight.dtype == fp8 for g in layers)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` (`x` itself without a residual) and its RMS norm with `weight`, for 2-D rows of the
    model's dtype: ``(x', weight * rms(x'))`` in one kernel a row. `fp8_rows`: up to `fp8_w8a8.PAD` rows also
    written in fp8 for the products of the normed rows (`fp8_w8a8.given_rows`; module doc)."""
    x = x.contiguous()
    rows, width = x.shape
    h = torch.empty_like(x)
    out_x = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual.contiguous()
    block = triton.next_power_of_2(width)
    quant = fp8_rows and rows <= fp8_w8a8.PAD
    q, scales = fp8_w8a8.row_buffers(rows, width, x.device) if quant else (h, h)  # (not written: h)
    _kernels()[0][(q.shape[0] if quant else rows,)](
        x, r, weight, out_x, h, q, scales, rows, width, eps, HAS_RESIDUAL=residual is not None, QUANT=quant,
        BLOCK=block, num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    if quant:
        fp8_w8a8.given_rows(h, q.view(torch.float8_e4m3fn), scales)
    return out_x, h


def silu_mul(gate_up: torch.Tensor, inter: int, fp8_rows: bool = False) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` for 2-D rows (the fused gate/up product). `fp8_rows`: up
    to `fp8_w8a8.PAD` rows also written in fp8 for the down product, as `add_rms_norm`'s (one program a row)."""
    gate_up = gate_up.contiguous()
    rows = gate_up.shape[0]
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if fp8_rows and rows <= fp8_w8a8.PAD:
        q, scales = fp8_w8a8.row_buffers(rows, inter, gate_up.device)
        block = triton.next_power_of_2(inter)
        _kernels()[1][(q.shape[0], 1)](
            gate_up, out, q, scales, rows, inter, QUANT=True, BLOCK=block, num_warps=min(16, max(4, block // 1024))
        )
        fp8_w8a8.given_rows(out, q.view(torch.float8_e4m3fn), scales)
        return out
    grid = (rows, triton.cdiv(inter, SILU_BLOCK))
    _kernels()[1][grid](gate_up, out, out, out, rows, inter, QUANT=False, BLOCK=SILU_BLOCK)
    return out


def rope(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The rotary embedding of the first `heads` heads (q's and k's) of each row of `qkv` (``[T, width]``,
    heads of `head_dim` side by side), as `layer_ops.rotate` computes it from the rows' `cos` and
    `signed_sin` (``[T, 1, head_dim]`` or ``[T, head_dim]``): ``[T, heads, head_dim]``, in one kernel (`rope_store`'s,
    storing nothing)."""
    qkv = qkv.contiguous()
    tokens = qkv.shape[0]
    cos, signed_sin = cos.reshape(tokens, head_dim).contiguous(), signed_sin.reshape(tokens, head_dim).contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    no_rows = torch.empty(1, dtype=torch.int32, device=qkv.device)  # (`rope_store`'s kernel storing nothing)
    _kernels()[2][(tokens, heads)](
        qkv, cos, signed_sin, out, qkv, qkv, no_rows, qkv, 0.0, 1.0, 1.0, qkv.shape[1], heads, 0, 0, head_dim,
        head_dim // 2, FP8=False, HEAD_NORM=False, BLOCK=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return out


def stores_in(target: KvStore, head_norm: NormWeight | None, dtype: torch.dtype) -> bool:
    """Whether `rope_store` can store a step's keys and values in `target`'s cache for a model of `dtype`: one of the
    model's dtype (or another float type), or e4m3 fp8 (its bytes made with integer ops: on any GPU; an e5m2 cache
    takes the backend's own write), the heads' norm (if any) an RMS norm whose weight is of the model's dtype
    (Qwen3's)."""
    fp8 = kv_quant.is_fp8(target.keys.dtype)
    plain = head_norm is None or (len(head_norm) == 2 and head_norm[0].dtype == dtype)
    return (not fp8 or target.keys.dtype == torch.float8_e4m3fn) and plain


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    target: KvStore,
    head_norm: NormWeight | None = None,
) -> torch.Tensor:
    """`rope`'s rotation of a fused q/k/v row's q and k heads (``[T, (heads + 2 * kv_heads) * head_dim]``), in one
    kernel that also stores the keys and values of the first ``target.written`` rows in the layer's cache as
    `kv_quant.store` stores them (`stores_in`): the rotated q heads, ``[T, heads, head_dim]``, for the backend's
    `attend_stored`. Four kernels fewer a layer than `rope` and the backend's write (the keys' and values' copies
    out of q/k/v and their two ``index_copy_``). `head_norm`: Qwen3's RMS norm of each q and k head before the
    rotation (`layout_variants.head_norm_weights`: a weight ``[heads + kv_heads, head_dim]`` of the model's dtype,
    and its epsilon), in the same kernel (the eager norm is some seven kernels more)."""
    qkv = qkv.contiguous()
    tokens, head_dim = qkv.shape[0], target.keys.shape[-1]
    cos, signed_sin = cos.reshape(tokens, head_dim).contiguous(), signed_sin.reshape(tokens, head_dim).contiguous()
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    fp8 = kv_quant.is_fp8(target.keys.dtype)
    keys, values = (target.keys.view(torch.uint8), target.values.view(torch.uint8)) if fp8 else target[:2]
    weight, eps = (qkv, 0.0) if head_norm is None else (head_norm[0].contiguous(), float(head_norm[1]))
    _kernels()[2][(tokens, heads + 2 * kv_heads)](
        qkv, cos, signed_sin, q, keys, values, target.rows, weight, eps, *target.scales, qkv.shape[1], heads,
        kv_heads, target.written, head_dim, half, FP8=fp8, HEAD_NORM=head_norm is not None,
        BLOCK=triton.next_power_of_2(half),
    )  # fmt: skip
    return q


def attend(backend: AttentionBackend, layer: int, q: torch.Tensor, meta: Any, fp8_rows: bool = False) -> torch.Tensor:
    """The backend's `attend_stored` of layer `layer` after `rope_store`: ``[T, heads * head_dim]``. `fp8_rows`: up to
    `fp8_w8a8.PAD` rows of a step the backend's kernel writes in fp8 too (`writes_fp8_rows`: the Triton kernel's,
    a decode graph's step) also written so and given to the o product (`fp8_w8a8.given_rows`), as the norms' rows
    are to theirs: no quantizing kernel of its own."""
    rows = q.shape[0]
    if not (fp8_rows and rows <= fp8_w8a8.PAD and backend.writes_fp8_rows(meta)):
        return backend.attend_stored(layer, q, meta)
    q8, scales = fp8_w8a8.row_buffers(rows, q.shape[1] * q.shape[2], q.device)
    out = backend.attend_stored(layer, q, meta, fp8_rows=(q8, scales))
    fp8_w8a8.given_rows(out, q8.view(torch.float8_e4m3fn), scales)
    return out
