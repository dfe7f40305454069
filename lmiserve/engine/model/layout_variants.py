"""What each architecture `FastLlama` runs adds to the Llama layout (engine/model/llama_layout.py), read from
the loaded transformers model:

- phi3: q/k/v and gate/up one linear each already (`projections`); a rotary embedding over a head's first
  part (Phi-4-mini's `partial_rotary_factor`) and LongRoPE are the RoPE tables' (engine/model/rope_tables.py);
- qwen3 and gemma3_text: an RMS norm over each query head and each key head before RoPE (`head_norms_reason`);
- granite: four scalars; gemma and gemma3_text: the embeddings scaled by the square root of the hidden size
  (rounded to the weights' dtype, as transformers does); gemma3_text: attention's scale from
  ``query_pre_attn_scalar`` and the logits soft-capped by ``final_logit_softcapping`` (`Multipliers`);
- gemma and gemma3_text: RMS norms that scale by ``1 + w``, in float32 before the cast back (`norm_of`);
- gemma3_text: norms of attention's and of the MLP's outputs too, before each is added ("sandwich" norms), and
  a RoPE table of its own for each kind of layer (local and global: `rope_kinds`);
- starcoder2: LayerNorms with biases (`norm_of`) and an MLP that is not gated (`c_fc`, the activation,
  `c_proj`: `projections`, `NON_GATED_TYPES`);
- glm and glm4: q/k/v apart, gate/up one linear (`projections`), RoPE over half of each head by interleaved
  pairs (`INTERLEAVED_ROPE_TYPES`: engine/model/rope_tables.py); glm4: norms of attention's and the MLP's outputs
  too (`norm_layout` "glm": `post_self_attn_layernorm`, `post_mlp_layernorm`);
- olmo2, olmo3 and exaone4: norms of attention's and the MLP's outputs alone, none of their inputs
  (`norm_layout`); olmo2's and olmo3's norms of the whole q and k projections (not of each head), with the
  weight applied before the cast back (`norm_of`); exaone4's norms of each head, and no RoPE on its full layers
  where it has sliding ones (`rope_layers`); olmo3's RoPE table by kind of layer.

- mixtral, qwen2_moe, qwen3_moe, glm4_moe and olmoe: a mixture of experts in place of the MLP on some or all
  layers, run by the model's own sparse-MoE block (`moe_block`: its router, its experts through transformers'
  experts implementation, a shared expert), between the fast forward's norms and residual adds; olmoe's norms of
  the whole q and k projections (`WHOLE_QK_NORM_TYPES`).

- gemma2: Gemma 3's sandwich norms and windows without its heads' norms, and its attention scores soft-capped
  (``attn_logit_softcapping``: `Multipliers.attention_softcap`, which the attention backends apply; not the
  compiled CPU kernel, which has no cap).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from lmiserve.engine.lora.batch import LoraGroup
from lmiserve.engine.model import grouped_experts
from lmiserve.engine.model.cpu_experts import KERNELS as CPU_EXPERTS

# decoders that only a vision-language model holds (engine/model/language_model.py): Qwen2's, Qwen3's with M-RoPE
VLM_DECODER_TYPES = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text")
# layers with experts (`moe_block`): Mistral's, Qwen2's, Qwen3's, GLM-4.5's (its partial RoPE by halves, Phi-4-mini's)
# and OLMoE's (norms of the whole q and k projections, as OLMo 2's, but Llama's norms of the layer's inputs)
# and gpt-oss's (its attention sinks: `attention_sinks`; q/k/v/o biases; its experts' biases and clamped SwiGLU)
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "olmoe", "qwen3_vl_moe_text", "gpt_oss")
SUPPORTED_TYPES = (
    "llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "seed_oss", "gemma", "gemma3_text",
    "olmo2", "olmo3", "exaone4", "starcoder2", "glm", "glm4", "gemma2", *VLM_DECODER_TYPES, *MOE_TYPES,
)  # fmt: skip
FUSED_TYPES = ("phi3",)  # q/k/v and gate/up one linear each in the model already (`projections`)
OFFSET_NORM_TYPES = ("gemma", "gemma2", "gemma3_text")  # RMS norms scaling by (1 + w) in float32 (`norm_of`)
LAYER_NORM_TYPES = NON_GATED_TYPES = ("starcoder2",)  # LayerNorms with biases; an MLP without a gate
INTERLEAVED_ROPE_TYPES = ("glm", "glm4")  # RoPE by pairs (2i, 2i + 1), not by halves; gate/up one linear
PROJECTION_NORM_TYPES = ("olmo2", "olmo3")  # norms of the whole q and k projections, the weight before the cast
WHOLE_QK_NORM_TYPES = (*PROJECTION_NORM_TYPES, "olmoe")  # norms of the whole q and k projections (OLMoE's: Llama's)
FP32_WEIGHT_NORM_TYPES = (*PROJECTION_NORM_TYPES, "gpt_oss")  # RMS norms whose weight multiplies before the cast
# RoPE types whose table is built once (LongRoPE's factors chosen from the served context: rope_tables.py)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")
# a layer's norms by `norm_layout`: Llama's (before attention, before the MLP), Gemma 3's sandwich, OLMo 2's after
_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": (
        "input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"
    ),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "glm": ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"),
}  # fmt: skip


class Multipliers(NamedTuple):
    """Scalars of the forward (the Llama layout's are these defaults): the embeddings' factor (Granite's;
    Gemma's square root of the hidden size), the residual branches' (Granite's: attention's and the MLP's
    outputs, before each is added), the logits' divisor (Granite's), attention's scale (None: one over the
    square root of a head's width; Granite's, Gemma 3's) and the logits' soft cap (Gemma 3's: ``tanh(l / c) *
    c``; None: none)."""

    embedding: float = 1.0
    residual: float = 1.0
    logits: float = 1.0
    attention: float | None = None
    softcap: float | None = None
    attention_softcap: float | None = None

    @classmethod
    def of(cls, model: Any) -> Multipliers:
        config = model.config
        get = functools.partial(getattr, config)
        attention = get("attention_multiplier", None)
        if get("query_pre_attn_scalar", None) is not None:  # Gemma 2/3
            attention = float(config.query_pre_attn_scalar) ** -0.5
        embedding = float(get("embedding_multiplier", 1.0))
        embed = model.model.embed_tokens
        if isinstance(getattr(embed, "embed_scale", None), torch.Tensor):  # Gemma's, in the weights' dtype
            embedding = float(embed.embed_scale.to(embed.weight.dtype))
        # (a VLM's decoder seen as a causal LM says whether its VLM caps: engine/model/language_model.py)
        softcap = get("final_logit_softcapping", None) if getattr(model, "caps_logits", True) else None
        scalars = (get("residual_multiplier", 1.0), get("logits_scaling", 1.0), attention, softcap)
        return cls(embedding, *scalars, get("attn_logit_softcapping", None))

    @property
    def plain(self) -> bool:
        return self == Multipliers()


def projections(model_type: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a layer's linears, attention's then the MLP's (each group's, then o's and down's):
    q/k/v and gate/up apart, or (`FUSED_TYPES`) one linear each."""
    if model_type in FUSED_TYPES:
        return ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
    if model_type in NON_GATED_TYPES:
        return ("q_proj", "k_proj", "v_proj", "o_proj"), ("c_fc", "c_proj")
    if model_type in INTERLEAVED_ROPE_TYPES:
        return ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_up_proj", "down_proj")
    return ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def norm_eps(norm: object) -> float | None:
    """An RMS norm's epsilon (Llama's `variance_epsilon`, Gemma's `eps`), None when it has none."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


NormWeight = tuple[torch.Tensor, float] | tuple[torch.Tensor, float, torch.Tensor]


def norm_of(norm: Any, model_type: str) -> NormWeight:
    """A norm as `layer_ops.rms_norm` applies it: an RMS norm's weight and epsilon (a float32 weight is applied
    before the cast back: Gemma's ``1 + w``, `OFFSET_NORM_TYPES`; OLMo 2's weight, `PROJECTION_NORM_TYPES`; as
    their norms do), or a LayerNorm's weight, epsilon and bias (`LAYER_NORM_TYPES`)."""
    eps = norm_eps(norm)
    if eps is None:
        raise ValueError(f"{type(norm).__name__} has no epsilon")
    if model_type in LAYER_NORM_TYPES:
        return norm.weight, eps, norm.bias
    if model_type in OFFSET_NORM_TYPES:
        return 1.0 + norm.weight.detach().float(), eps
    if model_type in FP32_WEIGHT_NORM_TYPES:
        return norm.weight.detach().float(), eps
    return norm.weight, eps


def norm_layout(layer: object) -> str:
    """Which norms `layer` has (`_NORMS`): ``pre`` (Llama's: before attention, and `post_attention_layernorm`
    before the MLP), ``sandwich`` (Gemma 3's: those, with `post_attention_layernorm` on attention's output and
    `post_feedforward_layernorm` on the MLP's) or ``post`` (OLMo 2's: on attention's and the MLP's outputs alone)."""
    if getattr(layer, "input_layernorm", None) is None:
        return "post"
    if getattr(layer, "post_self_attn_layernorm", None) is not None:  # GLM-4's sandwich, by other names
        return "glm"
    return "sandwich" if getattr(layer, "pre_feedforward_layernorm", None) is not None else "pre"


def norm_names(layer: object) -> tuple[str, ...]:
    """`layer`'s norms in the order `FusedLayer` takes them (`_NORMS`)."""
    return _NORMS[norm_layout(layer)]


def head_norm_weights(layers: Sequence[Any], heads: int, kv_heads: int) -> list[NormWeight | None]:
    """Each layer's norms of its query and key heads (`FusedLayer.head_norms`, Qwen3's) as one weight over the
    step's q and k heads side by side, with its epsilon (None: a layer without them)."""
    weights: list[NormWeight | None] = []
    for layer in layers:
        norms = layer.head_norms
        weights.append(
            None
            if norms is None
            else (torch.cat([norms[0].expand(heads, -1), norms[1].expand(kv_heads, -1)]), norms[2])
        )
    return weights


def rope_layers(config: Any) -> list[bool]:
    """Whether each layer rotates its queries and keys: not SmolLM3's `no_rope_layers` (0), nor EXAONE 4's full
    layers beside sliding ones."""
    layers = int(config.num_hidden_layers)
    if config.model_type == "exaone4" and getattr(config, "sliding_window", None) is not None:
        return [kind == "sliding_attention" for kind in config.layer_types[:layers]]
    return [bool(r) for r in getattr(config, "no_rope_layers", None) or [1] * layers]


def rope_kinds(model: Any) -> tuple[tuple[str | None, ...], list[int]]:
    """The RoPE tables a model's layers read, and each layer's among them: one table ``(None,)``; or, where
    the rotary module keeps one per kind of layer (Gemma 3's: `rope_type` a dict by layer kind; it is called
    with the kind), those kinds."""
    types = getattr(model.model.rotary_emb, "rope_type", "default")
    layers = int(model.config.num_hidden_layers)
    if not isinstance(types, dict):
        return (None,), [0] * layers
    kinds = tuple(types)
    return kinds, [kinds.index(kind) for kind in model.config.layer_types[:layers]]


def rope_reason(model: Any) -> str | None:
    """Why the model's RoPE tables cannot be built once for every length (None: they can)."""
    rope = getattr(getattr(model, "model", None), "rotary_emb", None)
    types = getattr(rope, "rope_type", "default") if rope is not None else None
    by_kind = types if isinstance(types, dict) else {None: types}
    if any(kind not in STATIC_ROPE for kind in by_kind.values()):
        return f"RoPE type {types!r}"
    if isinstance(types, dict) and not set(model.config.layer_types) <= set(types):
        return f"no RoPE table for some layer kinds ({sorted(set(model.config.layer_types) - set(types))})"
    return None


def layer_norms_reason(layer: Any, model_type: str, shape: Any) -> str | None:
    """Why a decoder layer's norms are not what the fast forward applies (None: they are): RMS norms as
    `norm_layout` names them, and norms of the queries and of the keys both or neither: of each head
    (qwen3, gemma3_text, exaone4: both) or of the whole projections (`WHOLE_QK_NORM_TYPES`: both)."""
    norms = [getattr(layer, name, None) for name in norm_names(layer)]
    if any(norm_eps(norm) is None for norm in norms):
        return "a layer's norms are not RMS norms with a weight and an epsilon"
    if model_type in LAYER_NORM_TYPES and not all(
        isinstance(n, torch.nn.LayerNorm) and n.bias is not None for n in norms
    ):
        return "a layer's norms are not LayerNorms with biases"
    if model_type in PROJECTION_NORM_TYPES and norm_layout(layer) != "post":
        return "an OLMo 2 layer with norms of its inputs"
    attn = getattr(layer, "self_attn", None)
    norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    whole = model_type in WHOLE_QK_NORM_TYPES
    widths = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim) if whole else (shape.head_dim,) * 2
    if (
        model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text", "gemma3_text", "exaone4")
        or model_type in WHOLE_QK_NORM_TYPES
        or any(norms)
    ) and not (
        all(_is_norm(n, w) for n, w in zip(norms, widths, strict=True)) and len({norm_eps(n) for n in norms}) == 1
    ):
        what = "the whole projections'" if whole else "one head's"
        return f"the query and key norms are not RMS norms of {what} width and one epsilon"
    return None


def _is_norm(norm: object, width: int) -> bool:
    """Whether `norm` is an RMS norm of `width` features (a head's: Qwen3's q_norm; OLMo 2's: the projection's)."""
    weight = getattr(norm, "weight", None)
    return isinstance(weight, torch.Tensor) and tuple(weight.shape) == (width,) and norm_eps(norm) is not None


def lora_groups(
    layers: Sequence[Any], model_type: str, shape: tuple[int, int, int], decoder: str = "model"
) -> list[LoraGroup]:
    """The groups `FastLlama` applies adapters to: each of `layers`' (`FusedLayer`) fused q/k/v, o, fused gate/up
    and down (``{layer}.qkv``, ...), their modules named as in the transformers model (Phi-3's, Starcoder2's and
    GLM's names: `projections`; under `decoder`, a VLM's ``model.language_model``); `shape`: the heads, the KV heads
    and a head's width."""
    heads, kv_heads, head_dim = shape
    q, kv = heads * head_dim, kv_heads * head_dim
    (*qkv_names, o), (*gate_up_names, down) = projections(model_type)
    groups = []
    for index, layer in enumerate(layers):
        at = f"{decoder}.layers.{index}"
        attn, mlp, inter, hidden = f"{at}.self_attn", f"{at}.mlp", layer.intermediate, layer.hidden
        qkv: tuple[tuple[str, int, int], ...] = ((f"{attn}.{qkv_names[0]}", 0, q + 2 * kv),)  # (Phi-3's qkv_proj)
        if len(qkv_names) == 3:
            qkv = tuple((f"{attn}.{n}", a, b) for n, a, b in zip(qkv_names, (0, q, q + kv), (q, q + kv, q + 2 * kv)))
        outputs = 2 * inter if model_type not in NON_GATED_TYPES else inter  # (one linear: gate/up, or c_fc)
        gate_up: tuple[tuple[str, int, int], ...] = ((f"{mlp}.{gate_up_names[0]}", 0, outputs),)
        if len(gate_up_names) == 2:
            gate_up = ((f"{mlp}.{gate_up_names[0]}", 0, inter), (f"{mlp}.{gate_up_names[1]}", inter, 2 * inter))
        groups += [LoraGroup(f"{index}.qkv", qkv, hidden), LoraGroup(f"{index}.o", ((f"{attn}.{o}", 0, hidden),), q)]
        if layer.moe is None:  # (a mixture of experts: none; create_engine serves adapters on transformers' forward)
            groups += [
                LoraGroup(f"{index}.gate_up", gate_up, hidden),
                LoraGroup(f"{index}.down", ((f"{mlp}.{down}", 0, hidden),), inter),
            ]
    return groups


def moe_block(layer: Any) -> torch.nn.Module | None:
    """`layer`'s mixture of experts (None: its MLP is dense): the model's own sparse-MoE block, which routes each
    token to its top experts and sums their outputs by the router's weights (Mixtral's, Qwen2-MoE's with its gated
    shared expert, Qwen3-MoE's, GLM-4.5's grouped sigmoid routing and shared expert, OLMoE's). It maps
    ``[1, T, hidden]`` to ``[1, T, hidden]``; its experts run through the model's experts implementation
    (transformers' ``grouped_mm`` by default: one grouped product a projection, no host sync, so a CUDA graph
    captures it in bfloat16)."""
    mlp = getattr(layer, "mlp", None)
    return mlp if hasattr(mlp, "experts") and (hasattr(mlp, "gate") or hasattr(mlp, "router")) else None


def moe_forward(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """`block`'s (`moe_block`) output ``[T, hidden]`` for the normed rows `h` (gpt-oss's returns its router's scores
    too)."""
    out = block(h[None])
    hidden: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return hidden[0]


def attention_sinks(layers: Sequence[Any]) -> list[torch.Tensor] | None:
    """Each decoder layer's attention sinks (gpt-oss's: one logit a head, in float32), None when the model has
    none (`AttentionBackend.sinks`)."""
    found = [getattr(layer.self_attn, "sinks", None) for layer in layers]
    sinks = [s for s in found if isinstance(s, torch.Tensor)]
    if not sinks:
        return None
    if len(sinks) != len(found):
        raise ValueError("attention sinks on some layers alone")
    return [s.detach().float() for s in sinks]


def experts_graph_reason(model: Any, layers: Sequence[Any]) -> str | None:
    """Why the decode graphs cannot capture a model's mixtures of experts (None: they can, or it has none): on
    CUDA, torch's grouped product reads its groups on the host (a sync) outside bfloat16, and transformers'
    eager experts loop over the experts hit (a sync each). Experts kept quantized (`grouped_experts`: Triton kernels
    whose tiles are found on the device) capture in any dtype; those on a CPU's kernels (`cpu_experts`) loop over
    the experts hit on the host."""
    moes = [layer.moe for layer in layers if layer.moe is not None]
    if any(grouped_experts.kept(getattr(moe, "experts", None), kernel) for moe in moes for kernel in CPU_EXPERTS):
        return "experts on the CPU's kernels loop over the experts hit on the host"
    if all(grouped_experts.kept(getattr(moe, "experts", None)) for moe in moes):
        return None
    implementation = getattr(model.config, "_experts_implementation", None)
    if implementation != "grouped_mm":
        return f"the experts implementation {implementation!r} waits for the device; grouped_mm does not"
    if model.dtype != torch.bfloat16:
        return f"the experts' grouped products wait for the device in {str(model.dtype).removeprefix('torch.')}"
    return None
