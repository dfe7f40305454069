"""What each architecture `FastLlama` runs adds to the Llama layout (engine/model/llama_layout.py), read from
the loaded transformers model:

- phi3: q/k/v and gate/up one linear each already (`projections`);
- qwen3 and gemma3_text: an RMS norm over each query head and each key head before RoPE (`head_norms_reason`);
- granite: four scalars; gemma and gemma3_text: the embeddings scaled by the square root of the hidden size
  (rounded to the weights' dtype, as transformers does); gemma3_text: attention's scale from
  ``query_pre_attn_scalar`` and the logits soft-capped by ``final_logit_softcapping`` (`Multipliers`);
- gemma and gemma3_text: RMS norms that scale by ``1 + w``, in float32 before the cast back (`norm_of`);
- gemma3_text: norms of attention's and of the MLP's outputs too, before each is added ("sandwich" norms:
  `sandwich`), and a RoPE table of its own for each kind of layer (local and global: `rope_kinds`).

Gemma 2 (soft-capped attention scores) and Gemma 3's vision-language models stay on transformers' forward.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

SUPPORTED_TYPES = (
    "llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "smollm3", "granite", "seed_oss", "gemma", "gemma3_text"
)  # fmt: skip
FUSED_TYPES = ("phi3",)  # q/k/v and gate/up one linear each in the model already (`projections`)
OFFSET_NORM_TYPES = ("gemma", "gemma3_text")  # RMS norms scaling by (1 + w) in float32 (`norm_of`)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # RoPE types whose table does not depend on the length
_SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # with post_attention_layernorm


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
        softcap = get("final_logit_softcapping", None)
        return cls(embedding, get("residual_multiplier", 1.0), get("logits_scaling", 1.0), attention, softcap)

    @property
    def plain(self) -> bool:
        return self == Multipliers()


def projections(model_type: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a layer's linears, attention's then the MLP's (each group's, then o's and down's):
    q/k/v and gate/up apart, or (`FUSED_TYPES`) one linear each."""
    if model_type in FUSED_TYPES:
        return ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
    return ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def norm_eps(norm: object) -> float | None:
    """An RMS norm's epsilon (Llama's `variance_epsilon`, Gemma's `eps`), None when it has none."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


def norm_of(norm: Any, model_type: str) -> tuple[torch.Tensor, float]:
    """An RMS norm as `fast_llama._rms` applies it: its weight and epsilon; for Gemma's (`OFFSET_NORM_TYPES`)
    ``1 + w`` in float32, which `_rms` applies before the cast back, as Gemma's norm does."""
    eps = norm_eps(norm)
    if eps is None:
        raise ValueError(f"{type(norm).__name__} has no epsilon")
    if model_type in OFFSET_NORM_TYPES:
        return 1.0 + norm.weight.detach().float(), eps
    return norm.weight, eps


def sandwich(layer: object) -> bool:
    """Whether `layer` norms its attention's and MLP's outputs too (Gemma 3: `post_attention_layernorm` on
    attention's output, `pre_feedforward_layernorm` before the MLP, `post_feedforward_layernorm` after it)."""
    return all(getattr(layer, name, None) is not None for name in _SANDWICH)


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
    config = model.config
    parameters = getattr(config, "rope_parameters", None)
    partial = getattr(config, "partial_rotary_factor", None) or (
        parameters.get("partial_rotary_factor") if isinstance(parameters, dict) else None
    )
    if partial not in (None, 1, 1.0):
        return f"a rotary embedding over part of each head ({partial})"
    return None


def layer_norms_reason(layer: Any, model_type: str, head_dim: int) -> str | None:
    """Why a decoder layer's norms are not what the fast forward applies (None: they are): an RMS norm
    before attention and one before the MLP (with a sandwich's two more), and a norm of each query and of each
    key head both or neither (qwen3 and gemma3_text: both)."""
    names = ["input_layernorm", "post_attention_layernorm"] + (list(_SANDWICH) if sandwich(layer) else [])
    if any(norm_eps(getattr(layer, name, None)) is None for name in names):
        return "a layer's norms are not RMS norms with a weight and an epsilon"
    attn = getattr(layer, "self_attn", None)
    norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if (model_type in ("qwen3", "gemma3_text") or any(norms)) and not (
        all(_is_head_norm(n, head_dim) for n in norms) and len({norm_eps(n) for n in norms}) == 1
    ):
        return "the query and key heads' norms are not RMS norms of one head's width and one epsilon"
    return None


def _is_head_norm(norm: object, head_dim: int) -> bool:
    """Whether `norm` is an RMS norm of one attention head's width (Qwen3's and Gemma 3's q_norm and k_norm)."""
    weight = getattr(norm, "weight", None)
    return isinstance(weight, torch.Tensor) and tuple(weight.shape) == (head_dim,) and norm_eps(norm) is not None
