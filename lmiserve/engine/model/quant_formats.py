"""The published quantized-checkpoint formats as lmiserve's linears (issue #39): fp8 (compressed-tensors'
``float-quantized`` and FBGEMM fp8) and 4-bit AWQ (GEMM packing) and GPTQ.

fp8: a ``float8_e4m3fn`` weight ``[out, in]`` with a fp32 scale per output channel (``[out, 1]``) or per
tensor (one value), ``w = weight * scale``. `Fp8Linear` keeps the fp8 weight and multiplies through
``torch._scaled_mm`` with the activations quantized to fp8 per row (token) at each call, as vLLM and
FBGEMM do (a checkpoint's static ``input_scale`` is not used). It is built on CUDA with compute
capability 8.9 or more (Ada, Hopper), and on a GPU without fp8 products (A100, A10G) where the loader keeps
the fp8 weights (`fp8_gemv.weights_kept_for`: bf16 would not fit, or ``LMISERVE_USE_TRITON_FP8=1``; the
products then widen the bytes in a Triton kernel). On a CPU (fp32 or bf16) the weights stay fp8 on the q8
kernel (`cpu_codes.fp8_layer`: a fourth of the fp32 bytes; de-quantized at load until 2026-12-07);
elsewhere `fp8_module` de-quantizes the weight once, at load, into a plain linear of the compute dtype (exact in
fp32). On an H200 (2026-11-29) the `_scaled_mm` path is correct and halves the
weights' memory, but decodes the 8B shape at 0.74x bf16's tokens/s at one stream (fp8_ops.py's doc).
Block-wise fp8 (``weight_scale_inv`` a block of rows and inputs) is an `Fp8Linear` with each row's block scales
where the loader keeps it (on any GPU, `fp8_gemv.weights_kept_for`), else de-quantized at load (`fp8_module`).

4-bit: both formats store codes 0..15 with, per group of `group_size` inputs, a fp16 scale and an
integer zero point: ``w[o, i] = (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]``.
- AWQ (AutoAWQ's ``WQLinear_GEMM``): ``qweight`` int32 ``[in, out / 8]`` whose word packs 8 outputs in the
  order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``k`` holds output ``AWQ_ORDER[k]``), ``qzeros`` int32
  ``[in / group, out / 8]`` packed the same way, ``scales`` ``[in / group, out]``; ``g(i) = i // group``.
- GPTQ (AutoGPTQ / optimum, ``checkpoint_format`` ``gptq``): ``qweight`` int32 ``[in / 8, out]`` packing 8
  inputs in order (nibble ``k`` of row ``r``: input ``8 r + k``), ``qzeros`` int32 ``[groups, out / 8]``
  packing 8 outputs in order and storing ``zero - 1`` (the v1 convention; ``gptq_v2`` stores ``zero``),
  ``scales`` ``[groups, out]``, ``g_idx`` int32 ``[in]`` (``g(i)``; not sorted with ``desc_act``).
- compressed-tensors' integer weights (``pack-quantized`` W4A16 and W8A16, ``int-quantized`` W8A8): unpacked into
  the same form by `packed_codes`.

`int4_module` and `int8_module` make the layer: on CPU, the codes on lmiserve's compiled kernels where they serve
them (`cpu_codes`: 4-bit `Int4Linear`, GGUF Q4_1's ``w = code * scale + min`` per group of 32, each group of 128
being 4 groups of 32 with the same ``scale`` and ``min = -zero * scale``; symmetric 8-bit `Q8Linear`; exact, since
``(code - zero) * scale`` of a fp16 scale is exact in fp32 either way; ``desc_act`` orders too, `input_order`).
Otherwise (other group sizes, bf16/fp16 compute, CUDA) the weight is de-quantized once at load into a plain linear:
on CUDA that is a first correct step (bf16 products, no memory saving). `int4_triton` holds a Triton kernel on the
codes, correct on an H200 but 10-30x slower there than the de-quantized bf16 products
(`benchmarks/quantized_kernels.py`; rewritten since, not yet measured), so it is used where the loader keeps the
codes (`int4_triton.codes_kept`: forced by ``LMISERVE_USE_TRITON_INT4=1``, or the de-quantized weights would not fit
the GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmiserve.engine import fp8_devices
from lmiserve.engine.model import cpu_codes, fp8_gemv, fp8_w8a8, input_order, int4_triton, int8_weights
from lmiserve.engine.model.codes_linear import CodesLinear
from lmiserve.engine.model.fp8_ops import FP8_MAX, dequantize_fp8, fp8_linear, quantize_fp8

__all__ = [
    "AWQ_ORDER",
    "FP8_MAX",
    "MODELOPT",
    "Fp8Linear",
    "Int4Parts",
    "QuantSpec",
    "block_grid",
    "dequantize_fp8",
    "fp8_linear",
    "fp8_module",
    "fp8_scaled_mm_supported",
    "int4_module",
    "int8_module",
    "one_scale_for",
    "quantize_fp8",
    "unpack_awq",
    "unpack_gptq",
    "unpack_words",
    "weights_kept_for",
]

MODELOPT = "modelopt"  # NVIDIA Model Optimizer's checkpoints (`QuantSpec.source`): their block scales' own name
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output AWQ_ORDER[k] of its 8
_AWQ_NIBBLE_OF = tuple(AWQ_ORDER.index(k) for k in range(8))  # output k's nibble: (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_words(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 words ``[..., n]`` as their 8 nibbles ``[..., n, 8]`` (nibble k = bits 4k..4k+3), int32 0..15; or, of
    `bits` 8, their 4 bytes ``[..., n, 4]``, 0..255."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization: `method` (fp8, awq, gptq, mxfp4), `source` (the checkpoint's
    ``quant_method``; ``dynamic``: fp8 made at load from float weights; ``dummy``: 4-bit codes made at load
    from `load_format=dummy`'s random weights, `quantize_int4_dummy`), the 4-bit `group_size`
    (-1: one group per row), whether GPTQ's stored zeros are ``zero - 1`` (`v1_zeros`), whether fp8's scales are
    block-wise (`blocks`: ``weight_block_size``, the rows and inputs of a block), and whether 8-bit integer weights
    take 8-bit integer activations (`int8_activations`: compressed-tensors' W8A8, `int8_w8a8`); GPTQ's `code_bits`
    (4, or 8: Qwen's GPTQ-Int8 releases)."""

    method: str
    source: str
    group_size: int = -1
    v1_zeros: bool = True
    blocks: tuple[int, int] | None = None
    packed: bool = False
    int8_activations: bool = False
    code_bits: int = 4

    @property
    def bits(self) -> int:
        """The integer codes' bits (compressed-tensors' int8 weights and GPTQ's 8-bit: 8; AWQ's, W4A16's: 4)."""
        return 8 if self.method == "int8" else self.code_bits

    @property
    def kernel_family(self) -> str:
        """The method whose kernels run the codes where a GPU keeps them (`weights_kept_for`): 8-bit codes int8's."""
        return "int8" if self.bits == 8 else self.method

    @property
    def int_codes(self) -> bool:
        """Whether the weights are compressed-tensors' integer codes (`packed_codes`: packed, or W8A8's int8)."""
        return self.packed or self.method == "int8"

    @property
    def codes_key(self) -> str:
        """The name of the tensor that says a linear is stored quantized (beside its weight's name)."""
        if self.packed:
            return "weight_packed"
        if self.method in ("fp8", "int8"):  # (block scales: transformers' name, ModelOpt's own)
            return "weight_scale_inv" if self.blocks and self.source != MODELOPT else "weight_scale"
        return "qweight"

    @property
    def dynamic(self) -> bool:
        return self.source == "dynamic"


@dataclass
class Int4Parts:
    """A 4-bit weight unpacked: ``codes`` uint8 ``[out, in]``, ``scale`` fp32 and ``zero`` int32
    ``[out, groups]``, ``g_idx`` int64 ``[in]`` (the group of each input); of `bits` 8, an 8-bit weight's (codes
    0..255: compressed-tensors' int8 weights, `unpack_int8`), whose activations may be quantized to int8 per row
    (`int8_rows`: W8A8's, `int8_w8a8`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    bits: int = 4
    int8_rows: bool = False

    def dequantize(self) -> torch.Tensor:
        """``(code - zero[g]) * scale[g]`` in fp32 ``[out, in]`` (exact for fp16 scales)."""
        zero = self.zero[:, self.g_idx].float()
        return (self.codes.float() - zero) * self.scale[:, self.g_idx]

    def group_size(self) -> int | None:
        """The size of the groups when every group is a run of consecutive inputs (``g(i) = i // size``)."""
        order, size = int4_triton.group_layout(self.g_idx, self.scale.shape[1])
        return size if order is None else None


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Parts:
    """AWQ GEMM tensors (`qweight` ``[in, out / 8]``, `qzeros` ``[in / group, out / 8]``, `scales` ``[in /
    group, out]``) as codes ``[out, in]`` and ``[out, groups]`` scales and zeros."""
    order = list(_AWQ_NIBBLE_OF)
    codes = unpack_words(qweight)[..., order].reshape(qweight.shape[0], -1)  # [in, out]
    zeros = unpack_words(qzeros)[..., order].reshape(qzeros.shape[0], -1)  # [groups, out]
    inputs = codes.shape[0]
    group = inputs if group_size <= 0 else group_size
    g_idx = torch.arange(inputs, device=codes.device) // group
    codes_oi = codes.t().to(torch.uint8).contiguous()
    return Int4Parts(codes_oi, scales.t().float().contiguous(), zeros.t().contiguous(), g_idx)


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    v1_zeros: bool = True,
    bits: int = 4,
) -> Int4Parts:
    """GPTQ tensors (`qweight` ``[in / 8, out]``, `qzeros` ``[groups, out / 8]``, `scales` ``[groups, out]``,
    `g_idx` ``[in]`` or None for ``i // group_size``; of `bits` 8, 4 codes a word) as codes ``[out, in]`` and
    ``[out, groups]`` scales and zeros; `v1_zeros`: the stored zeros are ``zero - 1`` (``checkpoint_format``
    ``gptq``)."""
    codes = unpack_words(qweight, bits).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = unpack_words(qzeros, bits).reshape(qzeros.shape[0], -1)  # [groups, out]
    if v1_zeros:
        zeros = zeros + 1  # v1 stores zero - 1; read as AutoGPTQ and vLLM do (code + 1: zeros 1..2**bits)
    inputs = codes.shape[0]
    if g_idx is None:
        group = inputs if group_size <= 0 else group_size
        g_idx = torch.arange(inputs, device=codes.device) // group
    codes, scales = codes.t().to(torch.uint8).contiguous(), scales.t().float().contiguous()
    return Int4Parts(codes, scales, zeros.t().contiguous(), g_idx.long(), bits)


def int4_module(
    parts: Int4Parts,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    keep_codes: bool | None = None,
) -> torch.nn.Module:
    """The layer of a 4-bit weight: on CPU (fp32 or bf16), `cpu_codes.layer` (`Int4Linear`, where its groups
    are runs of a multiple of 32 inputs; act-order's once sorted: `input_order`); on CUDA,
    `int4_triton`'s kernel on the codes where `keep_codes` (None: where ``LMISERVE_USE_TRITON_INT4=1``) and it serves
    the layout; else a plain linear of `dtype` with the weight de-quantized once (on CUDA: faster than the first
    Triton kernel on an H200). An 8-bit weight (`Int4Parts.bits`): `int8_module`."""
    if parts.bits == 8:
        return int8_module(parts, bias, dtype, device, keep_codes)
    kept = cpu_codes.layer(parts, bias, dtype) if device.type == "cpu" else None
    if kept is not None:
        return kept
    keep = int4_triton.USE_ON_CUDA is True if keep_codes is None else keep_codes
    kernel = device.type == "cuda" and keep and int4_triton.available()
    layout = int4_triton.Int4TritonLinear.layout(parts.g_idx, parts.scale.shape[1]) if kernel else None
    if layout is not None:  # (not yet measured)
        return int4_triton.Int4TritonLinear.from_parts(
            parts.codes, parts.scale, parts.zero, parts.g_idx, bias, dtype, device, layout
        )
    return _plain_linear(parts.dequantize(), bias, dtype, device)


def int8_module(
    parts: Int4Parts,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    keep_codes: bool | None = None,
) -> torch.nn.Module:
    """The layer of an 8-bit weight: where `keep_codes` (the loaders' `int8_weights.weights_kept_for` on CUDA;
    tests on a CPU) and the kernel serves its scales (`int8_weights.served_scales`), an `Int8WeightLinear` on
    `fp8_gemv`'s kernel; on CPU, symmetric codes keep a CPU kernel (`cpu_codes`: `Q8Linear` by groups, in fp32 or
    bf16; in bf16, with a scale a channel, `Int8Linear`); else a plain linear of `dtype` with the weight
    de-quantized once."""
    if keep_codes:  # (act-ordered groups: the inputs stored in group order, `input_order`)
        ordered, order, size = input_order.in_group_order(parts)
        served = int8_weights.served_scales(ordered.codes, ordered.scale, ordered.zero, size)
        if served is not None:
            b = None if bias is None else bias.detach().to(device, dtype)
            codes, o = int8_weights.signed_codes(ordered.codes).to(device), None if order is None else order.to(device)
            return int8_weights.Int8WeightLinear(codes, served.to(device), b, parts.int8_rows, o)
    kept = cpu_codes.layer(parts, bias, dtype) if device.type == "cpu" else None
    if kept is not None:
        return kept
    return _plain_linear(parts.dequantize(), bias, dtype, device)


def weights_kept_for(
    model: torch.nn.Module, device: torch.device, name: str, method: str, blocks: bool = False
) -> bool | None:
    """Whether the linears of a `method` checkpoint (fp8, awq, gptq, int8; `blocks`: block-wise fp8) stay quantized on
    a GPU where their kernel is not yet measured (`int4_triton.codes_kept_for`, `fp8_gemv.weights_kept_for`,
    `int8_weights.weights_kept_for`), for `model` (the meta model or a tensor-parallel rank's shell) on `device`;
    None where the question is not asked."""
    if method == "fp8":
        return fp8_gemv.weights_kept_for(model, device, name, blocks)
    if method == "int8":
        return int8_weights.weights_kept_for(model, device, name)
    return int4_triton.codes_kept_for(model, device, name)


def fp8_scaled_mm_supported(device: torch.device) -> bool:
    """Whether `Fp8Linear`'s fp8 product runs on `device`: CUDA with compute capability 8.9 or more."""
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") and fp8_devices.native(device)


class Fp8Linear(CodesLinear):
    """A linear layer with a ``float8_e4m3fn`` weight ``[out, in]`` and fp32 per-channel `scales` ``[out]``, or
    each row's scales by blocks of inputs ``[out, blocks]`` (block-wise fp8, `fp8_gemv.block_scales`)
    (`fp8_linear`; output in the input's dtype). `weight`, `scales` and `bias` are plain attributes (not
    parameters: ``Module.to(dtype)`` would cast fp8), so the fast path fuses them as it does int8 rows."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.scales = scales
        self.bias = bias

    def dequantized(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scales)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return fp8_linear(rows, self.weight, self.scales)

    def extra_repr(self) -> str:
        group = fp8_gemv.input_block(self.in_features, self.scales)
        scales = f"scales by blocks of {group} inputs" if group else "per channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 weights ({scales})"


def one_scale_for(modules: list[Fp8Linear]) -> None:
    """`Fp8Linear`s fused into one product (a layer's q, k and v; gate and up) whose scales are each one value (per
    tensor) put on one scale, the largest (as vLLM requantizes per-tensor checkpoints), where the GPU has fp8
    products (`fp8_devices.native`): the fused product's scales are then one value too, and one row of it runs on
    cuBLAS's tensor-wise product with both scales applied there (`fp8_w8a8.ONE_SCALE`). Each part's fp8 values
    are multiplied by its scale over the largest (at most 1: nothing overflows) and rounded to fp8 again. Parts
    with a scale a channel or by blocks, or all on one scale already, are left as they are."""
    if len(modules) < 2 or not fp8_devices.native(modules[0].weight.device):
        return
    if not all(fp8_w8a8.one_scale(m.scales) for m in modules):
        return
    firsts = torch.cat([m.scales[:1] for m in modules])
    top = firsts.max()
    if bool((firsts == top).all()):
        return
    for m, scale in zip(modules, firsts, strict=True):
        m.weight = (m.weight.float() * (scale / top)).to(torch.float8_e4m3fn)
        m.scales = top.reshape(1).expand(m.weight.shape[0]).contiguous()


def fp8_module(
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    keep_fp8: bool | None = None,
    block: tuple[int, int] | None = None,
) -> torch.nn.Module:
    """The layer of an fp8 weight: `Fp8Linear` where `fp8_scaled_mm_supported` or `keep_fp8` (the loaders'
    `fp8_gemv.weights_kept_for` on a GPU without fp8 products, or for block-wise scales on any GPU; tests on a
    CPU), else a plain linear of `dtype` with the weight de-quantized once, at load. `block`: `scale` is a
    block-wise checkpoint's (``weight_scale_inv``, blocks of ``block`` rows and inputs), kept only where asked and
    its blocks' inputs are a power of two (`fp8_gemv.block_scales`); a ``[out, blocks]`` `scale` without `block` is
    already each row's block scales (a tensor-parallel rank's cut of them)."""
    if block is not None:
        rows = fp8_gemv.block_scales(scale, weight.shape[0], weight.shape[1], block)
        kept = None if rows is None or keep_fp8 else _on_cpu(weight, rows, bias, dtype, device)
        if kept is not None:
            return kept
        if not keep_fp8 or rows is None:
            return _plain_linear(_block_dequantized(weight, scale, block), bias, dtype, device)
        scale = rows
    if keep_fp8 or fp8_scaled_mm_supported(device):
        if scale.dim() < 2 or scale.shape[1] == 1:  # per tensor or channel: every row's one (else each row's blocks)
            scale = scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
        b = None if bias is None else bias.detach().to(device, dtype)
        return Fp8Linear(weight.to(device), scale.to(device), b)
    kept = _on_cpu(weight, scale, bias, dtype, device)
    return kept if kept is not None else _plain_linear(dequantize_fp8(weight, scale), bias, dtype, device)


def _on_cpu(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module | None:
    """fp8 weights kept fp8 on a CPU (`cpu_codes.fp8_layer`, computing in fp32 or bf16), or None."""
    if device.type != "cpu":
        return None
    return cpu_codes.fp8_layer(weight.cpu(), scale.cpu(), bias)


def block_grid(scale: torch.Tensor, shape: Sequence[int], block: tuple[int, int]) -> torch.Tensor:
    """A block-wise checkpoint's `scale` as ``[row blocks, input blocks]`` for a weight of `shape` (ModelOpt's FP8_PB_WO
    stores it ``[row blocks, 1, input blocks, 1]``); ValueError where it is not one scale a block."""
    grid = scale
    if scale.dim() == 4 and scale.shape[1] == scale.shape[3] == 1:
        grid = scale.reshape(scale.shape[0], scale.shape[2])
    if tuple(grid.shape) != (-(-shape[0] // block[0]), -(-shape[1] // block[1])):
        raise ValueError(
            f"block scales of shape {list(scale.shape)} are not one a block of {block[0]} x {block[1]} of a "
            f"{list(shape)} weight"
        )
    return grid


def _block_dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-wise fp8 weight de-quantized in fp32: each value times its block's scale (exact)."""
    (out, inputs), (rows, width) = weight.shape, block
    full = scale.float().repeat_interleave(rows, dim=0)[:out].repeat_interleave(width, dim=1)[:, :inputs]
    return weight.float() * full


def _plain_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> torch.nn.Linear:
    out, inputs = weight.shape
    with torch.device("meta"):
        linear = torch.nn.Linear(inputs, out, bias=bias is not None)
    linear.weight = torch.nn.Parameter(weight.to(device, dtype), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)
    return linear
