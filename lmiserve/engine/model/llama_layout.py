"""The module layout of the Llama-family transformers models `FastLlama` runs, the check that a
model has it (`unsupported_reason`), and its layers' weights fused for one product per step.

Covers llama, mistral, ministral (windows on some layers), qwen2 (biases), seed_oss (biases, o's and the MLP's
too), and what engine/model/layout_variants.py reads of the others: qwen3's and gemma3_text's norms of each
query and key head (`FusedLayer.head_norms`), phi3's fused linears (`qkv_proj`, `gate_up_proj`; partial rotary
embeddings and LongRoPE: engine/model/rope_tables.py), smollm3's
layers without RoPE, granite's and Gemma's scalars, Gemma's ``1 + w`` norms and Gemma 3's norms of attention's
and the MLP's outputs (`FusedLayer.out_norms`) and RoPE tables by kind of layer, and the mixtures of experts of
mixtral, qwen2_moe, qwen3_moe, glm4_moe and olmoe (`FusedLayer.moe`: the model's own block); with the RoPE types whose
table does not depend on the sequence length; a sliding window (Mistral's ``sliding_window``, Qwen2's
``use_sliding_window`` from ``max_window_layers`` on, Gemma 3's sliding layers) only over the paged KV
cache, whose attention applies it
(engine/attention/windows.py). Layer linears may be float, weight-only int8 (`quantize.Int8Linear`,
``dtype=int8``: the fused matrices hold int8 rows and one scale per row), or at ``dtype=int4`` any mix of
int4 (`quantize.Int4Linear`: blocks of 16 rows of codes and of scales and minimums, `group_kernels`) and
q8 (`quantize.Q8Linear`: int8 codes with a scale per group of 16 or 32 inputs, a GGUF file's Q8_0, Q6_K
and Q5_0 tensors): a Q4_K_M file's attn_v and half its ffn_down are Q6_K. A fused group (q/k/v,
gate/up) whose linears are not all of one kind keeps its parts (`Part`: each run of linears of one kind
fused), whose products the forward concatenates; no weight is re-quantized.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch

from lmiserve.engine.attention.paged import AttentionShape
from lmiserve.engine.attention.windows import unsupported_kinds
from lmiserve.engine.model import input_order, layout_variants
from lmiserve.engine.model.int4_triton import Int4Scales, Int4TritonLinear
from lmiserve.engine.model.int8_weights import Int8Scales, Int8WeightLinear, fuse_int8
from lmiserve.engine.model.layout_variants import FUSED_TYPES as FUSED_TYPES
from lmiserve.engine.model.layout_variants import (
    NON_GATED_TYPES,
    WHOLE_QK_NORM_TYPES,
    NormWeight,
    moe_block,
    norm_layout,
    norm_names,
    norm_of,
    projections,
)
from lmiserve.engine.model.layout_variants import SUPPORTED_TYPES as SUPPORTED_TYPES
from lmiserve.engine.model.quant_formats import Fp8Linear, one_scale_for
from lmiserve.engine.model.quantize import INT4_ROW_BLOCK, Int4Linear, Int8Linear, Q8Linear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# the quantized linears the layout takes (tensor parallelism refuses them: sharding.py); Fp8Linear: fp8 rows,
# fused as int8's; Int4TritonLinear: AWQ/GPTQ codes on CUDA, fused by `_fuse_int4`; Int8WeightLinear: 8-bit integer
# codes on CUDA, fused by `int8_weights.fuse_int8`
QUANTIZED_LINEARS = (Int8Linear, Int4Linear, Q8Linear, Fp8Linear, Int4TritonLinear, Int8WeightLinear)


# ---- the layout (what `unsupported_reason` checks) -------------------------------------------------
class Norm(Protocol):  # RMSNorm
    weight: torch.Tensor
    variance_epsilon: float


class Attention(Protocol):
    q_proj: torch.nn.Linear
    k_proj: torch.nn.Linear
    v_proj: torch.nn.Linear
    o_proj: torch.nn.Linear


class Mlp(Protocol):
    gate_proj: torch.nn.Linear
    up_proj: torch.nn.Linear
    down_proj: torch.nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(Protocol):
    self_attn: Attention
    mlp: Mlp
    input_layernorm: Norm
    post_attention_layernorm: Norm


class Rotary(Protocol):
    rope_type: str

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Decoder(Protocol):
    embed_tokens: torch.nn.Embedding
    layers: Sequence[DecoderLayer]
    norm: Norm
    rotary_emb: Rotary


class LlamaFamily(Protocol):
    model: Decoder
    lm_head: torch.nn.Linear


def outputs_of(module: torch.nn.Module) -> int:
    """A linear's output features: a float linear's weight rows (tensor parallelism slices the weight and
    leaves `out_features` as it was), a quantized one's `out_features` (its rows are blocks of 16)."""
    if isinstance(module, torch.nn.Linear):
        return int(module.weight.shape[0])
    return int(module.out_features)  # type: ignore[arg-type]


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when `FastLlama` can run `model`, else a short reason for the log."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    kinds = unsupported_kinds(cfg)
    if kinds is not None:
        return kinds
    inner = getattr(model, "model", None)
    if getattr(inner, "rotary_emb", None) is None:
        return "no rotary embedding module"
    reason = layout_variants.rope_reason(model)
    if reason is not None:
        return reason
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(cfg, "clip_qkv", None) is not None:  # (OLMo's and OLMoE's option)
        return "clip_qkv (q, k and v clamped)"
    if getattr(model, "lm_head", None) is None or getattr(model.lm_head, "bias", None) is not None:
        return "no plain lm_head"
    attn_names, mlp_names = projections(cfg.model_type)
    shape = AttentionShape.of(cfg)
    for layer in getattr(inner, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        reason = layout_variants.layer_norms_reason(layer, cfg.model_type, shape)
        if reason is not None:
            return reason
        moe = moe_block(layer)  # (a mixture of experts: the model's own block runs it)
        if moe is not None and any(p.is_meta for p in moe.parameters()):
            return "a layer's experts are not loaded"
        names = [(attn, n) for n in attn_names] + ([] if moe is not None else [(mlp, n) for n in mlp_names])
        for owner, name in names:
            module = getattr(owner, name, None)
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.is_meta:
                return f"layer module {name} is not a plain linear"
            if not weight.is_floating_point() and not isinstance(module, QUANTIZED_LINEARS):
                return f"layer module {name} is not a plain floating-point, int8, int4 or q8 linear"
            if isinstance(module, (Int4Linear, Q8Linear)) and module.out_features % INT4_ROW_BLOCK:
                # int4 and q8 rows are stored in blocks of rows (quantize.INT4_ROW_BLOCK): a partial block pads outputs
                kind = "int4" if isinstance(module, Int4Linear) else "q8"
                return f"{kind} {name} outputs are not a multiple of {INT4_ROW_BLOCK}"
            if isinstance(module, Q8Linear) and _q8_group(module) not in (16, 32):
                return f"q8 {name} has groups of {_q8_group(module)} inputs (the kernel takes 16 or 32)"
        for group in (attn_names[:-1], mlp_names[:-1])[: 1 if moe is not None else 2]:
            owner = attn if group[0] == attn_names[0] else mlp
            modules = [getattr(owner, n) for n in group]
            grouped = all(isinstance(m, (Int4Linear, Q8Linear)) for m in modules)  # any mix: kept as parts
            if len({type(m) for m in modules}) > 1 and not grouped:
                return f"{'/'.join(group)} are not all of one kind (float, int8, or int4 and q8)"
    return None


def _q8_group(module: Q8Linear) -> int:
    """Inputs per scale of a q8 linear (its scales: ``[blocks, in / group * 16]``)."""
    return module.in_features * INT4_ROW_BLOCK // module.scales.shape[1]


def as_llama(model: PreTrainedModel) -> LlamaFamily:
    """`model` seen through its Llama-family layout; ValueError when it does not have it."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"FastLlama cannot run this model: {reason}")
    return cast(LlamaFamily, model)  # the layout was just checked


# ---- fused weights -------------------------------------------------------------------------------
Scales = torch.Tensor | Int4Scales | Int8Scales | input_order.InputOrder | None  # a product's scales: `_fuse`'s


class Part(NamedTuple):
    """One product of a layer: a (fused) weight in the model's ``[out, in]`` layout (int4 and q8: blocks
    of 16 rows; AWQ/GPTQ codes: ``[out, in / 8]`` words with their `Int4Scales`), its bias, its scales (None:
    float) and its output features."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scales: Scales
    outputs: int


class FusedLayer:
    """One decoder layer's weights as `FastLlama` reads them: q/k/v and gate/up fused into one
    matrix each (in the model's own ``[out, in]`` layout). For int8, int4 and q8 layers each matrix has
    its scales (`*_s`, see `_fuse`); None for float layers. A group of an int4 model whose linears mix
    int4 and q8 (a Q4_K_M file's q/k/v: attn_v is Q6_K) keeps its parts (`qkv`, `gate_up`: each run of
    one kind fused; `qkv_w` and the like are those of a group of one part only)."""

    def __init__(self, layer: DecoderLayer, model_type: str = "llama") -> None:
        attn, mlp = layer.self_attn, layer.mlp
        (*qkv, o), (*gate_up, down) = projections(model_type)
        self.qkv = _fuse_runs([getattr(attn, name) for name in qkv])
        self.o_w, self.o_b, self.o_s = _fuse([getattr(attn, o)])
        # a mixture of experts in place of the MLP (`layout_variants.moe_block`; None: a dense MLP, fused below)
        self.moe = moe_block(layer)
        self.gate_up: tuple[Part, ...] = ()
        self.down_w: torch.Tensor = torch.empty(0)  # (an MoE layer's: none)
        self.down_b: torch.Tensor | None = None
        self.down_s: Scales = None
        if self.moe is None:
            self.gate_up = _fuse_runs([getattr(mlp, name) for name in gate_up])
            self.down_w, self.down_b, self.down_s = _fuse([getattr(mlp, down)])
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None) or getattr(mlp, "act", None)
        self.act: Callable[[torch.Tensor], torch.Tensor] = cast(Callable[[torch.Tensor], torch.Tensor], act)
        self.gated = model_type not in NON_GATED_TYPES  # act(gate) * up; else (Starcoder2's) act(c_fc)
        # the norms before attention and before the MLP (None: OLMo 2's, which has none), and those of attention's
        # and the MLP's outputs (Gemma 3's and OLMo 2's; None: none): `layout_variants.norm_layout`
        norms = [norm_of(getattr(layer, name), model_type) for name in norm_names(layer)]
        self.in_norm: NormWeight | None = None
        self.post_norm: NormWeight | None = None
        self.out_norms: tuple[NormWeight, NormWeight] | None = None
        layout = norm_layout(layer)
        if layout == "post":
            self.out_norms = (norms[0], norms[1])
        else:
            self.in_norm, self.post_norm = norms[0], norms[1]
            self.out_norms = (norms[2], norms[3]) if layout in ("sandwich", "glm") else None
        self.intermediate = sum(part.outputs for part in self.gate_up) // (2 if self.gated else 1)  # gate's
        self.hidden = outputs_of(getattr(attn, o))  # o's and down's outputs
        # Qwen3's and Gemma 3's RMS norms of each query head and of each key head (one head's width), or None;
        # OLMo 2's of the whole q and k projections (`proj_norms`), or None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self.proj_norms: tuple[NormWeight, NormWeight] | None = None
        if q_norm is not None and k_norm is not None and model_type in WHOLE_QK_NORM_TYPES:
            self.proj_norms = (norm_of(q_norm, model_type), norm_of(k_norm, model_type))
        elif q_norm is not None and k_norm is not None:
            q, k = norm_of(q_norm, model_type), norm_of(k_norm, model_type)
            self.head_norms = (q[0], k[0], q[1])

    @property
    def fused(self) -> bool:
        """Whether q/k/v and gate/up are one product each (every group's linears of one kind)."""
        return len(self.qkv) == 1 and len(self.gate_up) == 1

    def parts(self) -> list[Part]:
        """Every product of the layer (the weights a step reads)."""
        o = Part(self.o_w, self.o_b, self.o_s, self.hidden)
        if self.moe is not None:  # (its experts' weights: the model's block reads them)
            return [*self.qkv, o]
        down = Part(self.down_w, self.down_b, self.down_s, self.hidden)
        return [*self.qkv, o, *self.gate_up, down]

    @property
    def qkv_w(self) -> torch.Tensor:
        return _one(self.qkv).weight

    @property
    def qkv_b(self) -> torch.Tensor | None:
        return _one(self.qkv).bias

    @property
    def qkv_s(self) -> Scales:
        return _one(self.qkv).scales

    @property
    def gate_up_w(self) -> torch.Tensor:
        return _one(self.gate_up).weight

    @property
    def gate_up_b(self) -> torch.Tensor | None:
        return _one(self.gate_up).bias

    @property
    def gate_up_s(self) -> Scales:
        return _one(self.gate_up).scales


def _one(parts: tuple[Part, ...]) -> Part:
    if len(parts) != 1:
        raise ValueError("this group's linears are of several kinds: it has no one fused matrix (see `parts`)")
    return parts[0]


# The fused layers of each model, fused once: fusing points the model's modules at rows of the fused
# weights, so a later engine on the same model shares them (fusing again would copy every weight).
# Weak keys: an entry goes with its model (the layers reference its tensors, not the model).
_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, list[FusedLayer]] = weakref.WeakKeyDictionary()


def fused_layers(model: PreTrainedModel) -> list[FusedLayer]:
    """The fused layers of `model` (fused at the first call; ValueError if it is not Llama-family)."""
    layers = _FUSED.get(model)
    if layers is None:
        kind = model.config.model_type
        layers = _FUSED[model] = [FusedLayer(layer, kind) for layer in as_llama(model).model.layers]
    return layers


def _kind(module: torch.nn.Module) -> object:
    """What fuses with what: float linears of one dtype, int8 rows, int4 blocks, q8 blocks of one group."""
    if isinstance(module, Q8Linear):
        return Q8Linear, module.weight.dtype, _q8_group(module), input_order.key(module)  # (int8 or fp8 codes)
    if isinstance(module, (Int8Linear, Int4Linear, Fp8Linear)):  # (and int4's stored inputs' order: `input_order`)
        return type(module), input_order.key(module)
    if isinstance(module, Int4TritonLinear):  # fused only with linears of the same groups and input order
        order = module.scales.order
        return Int4TritonLinear, module.scales.group, None if order is None else tuple(order.tolist())
    if isinstance(module, Int8WeightLinear):  # fused only with linears of the same scales' layout
        return Int8WeightLinear, module.scales.scales.shape[1:], input_order.key(module)
    return cast(torch.nn.Linear, module).weight.dtype


def _fuse_runs(modules: list[torch.nn.Linear]) -> tuple[Part, ...]:
    """`modules` (which read the same input) as products whose outputs, concatenated, are theirs in
    order: each run of consecutive linears of one kind (`_kind`) fused by `_fuse` (one part when they
    are all of one kind)."""
    runs: list[list[torch.nn.Linear]] = []
    for m in modules:
        if runs and _kind(runs[-1][0]) == _kind(m):
            runs[-1].append(m)
        else:
            runs.append([m])
    parts = []
    for run in runs:
        outputs = sum(outputs_of(m) for m in run)
        parts.append(Part(*_fuse(run), outputs))
    return tuple(parts)


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, Scales]:
    """One weight for several linears that read the same input (``[sum of out, in]``, contiguous,
    the model's own output-major layout), its bias and the scales of quantized linears (all of one
    kind): int8 rows' scales ``[out]``, int4 blocks' scales and minimums ``[out / 16, in]``, q8 blocks'
    scales ``[out / 16, in / group * 16]`` (int4 and q8 weights are stored in blocks of
    `INT4_ROW_BLOCK` output rows, `group_kernels`, so matrices whose rows fill whole blocks
    concatenate; `unsupported_reason` checks it). Each module is pointed at its rows (blocks), so memory
    does not grow and the transformers forward keeps working on the same storage."""
    if isinstance(modules[0], Int4TritonLinear):
        return _fuse_int4(cast(list[Int4TritonLinear], modules))
    if isinstance(modules[0], Int8WeightLinear):
        weight, bias, fused = fuse_int8(cast(list[Int8WeightLinear], modules), _fused_bias(modules))
        return weight, bias, input_order.with_order(fused, modules[0])
    if isinstance(modules[0], Fp8Linear):  # parts of one scale each: on one scale (tensor-wise products)
        one_scale_for(cast(list[Fp8Linear], modules))
    weights = [m.weight.detach() for m in modules]
    stored = weights[0].contiguous() if len(weights) == 1 else torch.cat(weights, dim=0)
    quantized = [cast(Int8Linear | Int4Linear | Q8Linear, m) for m in modules if isinstance(m, QUANTIZED_LINEARS)]
    if quantized and len(quantized) != len(modules):
        raise ValueError("mixed quantized and float linears")
    scales = torch.cat([m.scales for m in quantized], dim=0) if quantized else None
    bias = _fused_bias(modules)
    row = out = 0  # the module's first stored row (an int4 block) and first output
    for m in modules:
        n, outputs = m.weight.shape[0], outputs_of(m)
        if isinstance(m, QUANTIZED_LINEARS):
            m.weight = stored[row : row + n]
            m.bias = None if bias is None else bias[out : out + outputs]
            if scales is not None:
                m.scales = scales[row : row + n]
        else:
            m.weight = torch.nn.Parameter(stored[row : row + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
        out += outputs
    return stored, bias, input_order.with_order(scales, modules[0])  # (GPTQ's act-order: `input_order`)


def _fuse_int4(modules: list[Int4TritonLinear]) -> tuple[torch.Tensor, torch.Tensor | None, Int4Scales]:
    """`_fuse` for AWQ/GPTQ codes (`int4_triton`) of one `_kind` (the same groups and input order): the codes'
    rows concatenated, the scales' and zeros' columns (``[groups, sum of out]``), the biases (all or
    none); each module pointed at its rows and columns."""
    first = modules[0].scales
    weight = torch.cat([m.weight for m in modules], dim=0) if len(modules) > 1 else modules[0].weight
    scales = torch.cat([m.scales.scales for m in modules], dim=1) if len(modules) > 1 else first.scales
    zeros = torch.cat([m.scales.zeros for m in modules], dim=1) if len(modules) > 1 else first.zeros
    bias = _fused_bias(modules)
    fused = Int4Scales(scales, zeros, first.order, first.group)
    out = 0
    for m in modules:
        n = m.out_features
        m.weight = weight[out : out + n]
        m.scales = Int4Scales(scales[:, out : out + n], zeros[:, out : out + n], first.order, first.group)
        m.bias = None if bias is None else bias[out : out + n]
        out += n
    return weight, bias, fused


def _fused_bias(modules: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    """The biases of linears fused into one product, concatenated (None: none has one; ValueError: only some)."""
    present = [cast(torch.Tensor, m.bias).detach() for m in modules if m.bias is not None]
    if present and len(present) != len(modules):
        raise ValueError("mixed biases")
    return torch.cat(present, dim=0) if present else None
