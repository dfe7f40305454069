"""`FastLlama`'s decoder layers for a model whose layer products are all q4 or q8 (``dtype=int4``, a
checkpoint's 4-bit or symmetric 8-bit codes, or its fp8 weights: `cpu_codes`; `group_kernels`), on steps of a
few rows: each layer in four kernel calls and the attention, the small ops folded into the kernels' input and
output sides.

Per layer: ``qkv = rms(x) @ Wqkv.T`` (the RMS norm formed in the kernel, `group_kernels.PRE_RMS`),
RoPE in place on q and k (a compiled loop), the attention backend, ``x += attn @ Wo.T`` (the residual
add in the kernel's output side), ``gate_up = rms(x) @ Wgu.T``, ``x += (silu(gate) * up) @ Wd.T``
(`PRE_SILU_MUL`); the output projection with the final norm the same way. Buffers are numpy arrays
made once a step, weights numpy views made once (`group_kernels.Packed`), so a product costs its kernel
call and little else. The values are those of the op-by-op path (`FastLlama._layers`) up to the RMS
norm's summation order (fp32 throughout); RoPE and the residual adds are the same fp32 ops.

Taken where it applies (`PackedLayers.of`: q4 layers without biases, SiLU, fp32, CPU, the whole model,
not a tensor-parallel shard; GPTQ's act-order too, each product's input gathered: `_Layer`) and for
steps without LoRA rows (the adapters read the products' inputs) of at most `MAX_ROWS` tokens (the input is
formed on one thread: longer prompt chunks keep torch's parallel ops)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmiserve.engine.attention import backends
from lmiserve.engine.jit import numba
from lmiserve.engine.model import group_kernels, input_order
from lmiserve.engine.model.group_kernels import PRE_RMS, PRE_SILU_MUL, Packed
from lmiserve.engine.model.input_order import InputOrder

MAX_ROWS = 32
_CODES = (torch.uint8, torch.int8, torch.float8_e4m3fn)  # q4 codes; q8's int8 codes or fp8 values


def _rope(qkv: Any, heads: int, head_dim: int, cos: Any, sin: Any) -> None:  # pragma: no cover - compiled
    """transformers' rotate-half RoPE in place on the first `heads` heads of each row of `qkv` (``sin``
    signed as `layer_ops.rotate`'s table: the same fp32 products and sums)."""
    half = head_dim // 2
    for m in range(qkv.shape[0]):
        for h in range(heads):
            at = h * head_dim
            for d in range(half):
                a, b = qkv[m, at + d], qkv[m, at + half + d]
                qkv[m, at + d] = a * cos[m, d] + b * sin[m, d]
                qkv[m, at + half + d] = b * cos[m, half + d] + a * sin[m, half + d]


@functools.cache
def _rope_compiled() -> Any:
    return numba.njit(cache=True, nogil=True)(_rope)  # no fastmath: bit-identical to torch's ops


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _norm(norm: tuple[torch.Tensor, float]) -> tuple[Any, float] | None:
    weight, eps = norm
    if weight.dtype != torch.float32:
        return None
    return weight.detach().contiguous().numpy(), float(eps)


def _order(scales: Any) -> Any:
    """The stored inputs' order of a product (GPTQ's act-order: `input_order.InputOrder`) as numpy, or None."""
    return scales.order.numpy() if isinstance(scales, InputOrder) else None


def _taken(x: Any, order: Any) -> Any:
    """`x`'s columns in the stored `order` (a C-contiguous copy; None: `x` itself)."""
    return x if order is None else np.take(x, order, axis=1)


class _Layer:
    """A layer's four products. Where their inputs are stored in group order (GPTQ's act-order, `input_order`),
    each input is gathered first (`_taken`); the norms before q/k/v and gate/up take their weights in that order too,
    which gives the gathered normed rows (the RMS is the same over the gathered row), and the SiLU's product before
    down gathers gate's and up's columns alike."""

    __slots__ = ("down", "gate_up", "in_eps", "in_w", "o", "orders", "post_eps", "post_w", "qkv")

    def __init__(self, layer: Any, in_norm: tuple[Any, float], post_norm: tuple[Any, float]) -> None:
        scales = (layer.qkv_s, layer.o_s, layer.gate_up_s, layer.down_s)
        stored = (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
        weights = [Packed(w, input_order.scales_of(s)) for w, s in zip(stored, scales, strict=True)]
        self.qkv, self.o, self.gate_up, self.down = weights
        qkv, o, gate_up, down = (_order(s) for s in scales)
        if down is not None:  # (gate's columns, then up's)
            down = np.concatenate([down, down + layer.intermediate])
        self.orders = (qkv, o, gate_up, down)
        self.in_w, self.in_eps = in_norm[0] if qkv is None else in_norm[0][qkv], in_norm[1]
        self.post_w, self.post_eps = post_norm[0] if gate_up is None else post_norm[0][gate_up], post_norm[1]

    @classmethod
    def of(cls, layer: Any, shape: tuple[int, int, int], hidden: int) -> _Layer | None:
        """None unless the layer is q4 without biases, with SiLU and fp32 norms, in whole blocks."""
        if not layer.fused:  # q/k/v or gate/up mixing q4 and q8 (a Q4_K_M file's): the op-by-op path
            return None
        weights = (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)
        scales = (layer.qkv_s, layer.o_s, layer.gate_up_s, layer.down_s)
        biases = (layer.qkv_b, layer.o_b, layer.gate_up_b, layer.down_b)
        if any(w.dtype not in _CODES or w.device.type != "cpu" for w in weights):
            return None
        heads, kv_heads, head_dim = shape
        inputs = (hidden, heads * head_dim, hidden, layer.intermediate)
        if not all(group_kernels.blocked(w, k) for w, k in zip(weights, inputs, strict=True)):
            return None
        groups = [input_order.scales_of(s) for s in scales]  # (int8 rows' 1-D scales: no)
        if any(not isinstance(s, torch.Tensor) or s.dim() != 2 for s in groups):
            return None
        in_norm, post_norm = _norm(layer.in_norm), _norm(layer.post_norm)
        if any(b is not None for b in biases) or not _is_silu(layer.act) or in_norm is None or post_norm is None:
            return None
        p = cls(layer, in_norm, post_norm)
        inter = layer.intermediate
        widths = [(p.qkv, hidden, (heads + 2 * kv_heads) * head_dim), (p.o, heads * head_dim, hidden)]
        widths += [(p.gate_up, hidden, 2 * inter), (p.down, inter, hidden)]
        if any(w.inner != k or w.n != n for w, k, n in widths):  # padded blocks: the op-by-op path
            return None
        return p


class PackedLayers:
    """The layers (and the output projection when it is q4/q8 too) as `group_kernels.Packed` weights."""

    def __init__(
        self, layers: list[_Layer], head: Packed | None, norm: tuple[Any, float] | None, shape: tuple[int, int, int]
    ) -> None:
        self.layers, self.head, self.norm = layers, head, norm
        self.heads, self.kv_heads, self.head_dim = shape

    @classmethod
    def of(
        cls,
        layers: Sequence[Any],
        shape: tuple[int, int, int],
        norm: tuple[torch.Tensor, float],
        head: tuple[torch.Tensor, torch.Tensor | None],
    ) -> PackedLayers | None:
        """None unless every layer is q4 without biases, with SiLU and fp32 norms, in whole blocks."""
        if not layers or not group_kernels.available():
            return None
        hidden = layers[0].o_w.shape[0] * group_kernels.LANES
        packed = []
        for layer in layers:
            p = _Layer.of(layer, shape, hidden)
            if p is None:
                return None
            packed.append(p)
        weight, head_scales = head
        out = None
        if (
            isinstance(head_scales, torch.Tensor)
            and head_scales.dim() == 2
            and weight.dtype in _CODES
            and group_kernels.blocked(weight, hidden)
        ):
            out = Packed(weight, head_scales)
        return cls(packed, out, _norm(norm), shape)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any, attention: Any) -> torch.Tensor:
        """The decoder layers over hidden states ``x`` (fp32 ``[T, hidden]``, updated in place and
        returned); RoPE rows `cos`/`sin` (``[T, 1, D]``)."""
        xn = x.numpy()
        rows, heads, kv_heads, dim = xn.shape[0], self.heads, self.kv_heads, self.head_dim
        first = self.layers[0]
        qkv = np.empty((rows, first.qkv.n), dtype=np.float32)
        gate_up = np.empty((rows, first.gate_up.n), dtype=np.float32)
        qkv_t = torch.from_numpy(qkv)
        q_size, kv_size = heads * dim, kv_heads * dim
        q = qkv_t[:, :q_size].view(rows, heads, dim)
        k = qkv_t[:, q_size : q_size + kv_size].view(rows, kv_heads, dim)
        v = qkv_t[:, q_size + kv_size :].view(rows, kv_heads, dim)
        c, s = cos.reshape(rows, dim).numpy(), sin.reshape(rows, dim).numpy()
        rope, forward = _rope_compiled(), attention.forward
        lean = attention.decode_kernel(meta) if isinstance(attention, backends.CpuKernelBackend) else None
        if lean is not None:  # decode rows alone: the compiled attention on numpy views of qkv
            qa = qkv[:, :q_size].reshape(rows, kv_heads, heads // kv_heads, dim)
            ka = qkv[:, q_size : q_size + kv_size].reshape(rows, kv_heads, dim)
            va = qkv[:, q_size + kv_size :].reshape(rows, kv_heads, dim)
            views = all(a.flags.c_contiguous for a in (qa, ka, va))  # one row; else copies a layer
            out = np.empty_like(qa, order="C")
            flat = out.reshape(rows, q_size)
        for index, layer in enumerate(self.layers):
            qkv_order, o_order, gate_up_order, down_order = layer.orders
            layer.qkv(_taken(xn, qkv_order), qkv, PRE_RMS, layer.in_w, layer.in_eps)
            rope(qkv, heads + kv_heads, dim, c, s)
            if lean is not None:
                if views:
                    lean(index, qa, ka, va, out)
                else:
                    lean(index, np.ascontiguousarray(qa), np.ascontiguousarray(ka), np.ascontiguousarray(va), out)
                layer.o(_taken(flat, o_order), xn, add=True)
            else:
                attn = forward(index, q, k, v, meta)
                if not attn.is_contiguous() or attn.dtype != torch.float32:
                    attn = attn.float().contiguous()
                layer.o(_taken(attn.numpy(), o_order), xn, add=True)
            layer.gate_up(_taken(xn, gate_up_order), gate_up, PRE_RMS, layer.post_w, layer.post_eps)
            layer.down(_taken(gate_up, down_order), xn, PRE_SILU_MUL, add=True)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """The final norm and the output projection (fp32 ``[T, padded vocabulary]``), None when the
        output projection is not a q4/q8 one."""
        head, norm = self.head, self.norm
        if head is None or norm is None:
            return None
        if not x.is_contiguous() or x.dtype != torch.float32:
            x = x.float().contiguous()
        out = np.empty((x.shape[0], head.n), dtype=np.float32)
        head(x.numpy(), out, PRE_RMS, norm[0], norm[1])
        return torch.from_numpy(out)
