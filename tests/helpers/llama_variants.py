"""Tiny random models of the Llama-family architectures the fast forward covers, and the engine runs that
check them against `generate()` (tests/unit/test_fast_llama.py, tests/unit/test_triton_attention.py)."""

from __future__ import annotations

import asyncio
import copy

import torch
from transformers import (
    Exaone4Config,
    Exaone4ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

from lmiserve.core.request import GenerationRequest, SamplingParams
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import create_engine

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=2,
    pad_token_id=3,
    bos_token_id=1,
)
LONGROPE = {
    "partial_rotary_factor": 0.75,  # of heads of 16: 12 rotated
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.7 * i for i in range(6)],
    },
}
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_scaled_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral_no_window": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    # Qwen3: an RMS norm over each query and key head; a head wider than hidden / heads (Qwen3-0.6B's too)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
    # Phi-3: q/k/v and gate/up one linear each (qkv_proj, gate_up_proj); a window over every layer (Phi-3-mini's)
    "phi3_window": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 16}),
    # Ministral: a window on some layers (layer_types); Seed-OSS: biases on q/k/v, o and the MLP's linears
    "ministral_window": (
        MinistralConfig,
        MinistralForCausalLM,
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16},
    ),
    "seed_oss_bias": (
        SeedOssConfig,
        SeedOssForCausalLM,
        {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True},
    ),
    # SmolLM3: no rotary embedding in every n-th layer (here the second of two)
    "smollm3_nope": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layer_interval": 2}),
    # Granite: its four scalars (Granite 3's: the embeddings x 12, the residual branches x 0.22, logits / 8, and
    # an attention scale of its own)
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_multiplier": 0.1},
    ),
    # Gemma: norms scaling by (1 + w), the embeddings by sqrt(hidden), GELU; heads wider than hidden / heads
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 32}),
    # Gemma 3: norms of each head and of attention's and the MLP's outputs, a window on every other layer with
    # a RoPE base of its own (the full layers' scaled), attention's scale from query_pre_attn_scalar, and the
    # logits soft-capped (Gemma 2's 30; here 3, low enough to change tokens)
    "gemma3_window": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
        },
    ),
    # Gemma 2: Gemma 3's sandwich norms and windows (without its heads' norms), its attention scores soft-capped
    # (50 published; here 2, low enough to change them) and the logits (30 published; here 3)
    "gemma2_window": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    # OLMo 2: norms of attention's and the MLP's outputs alone; of the whole q and k projections (not each head)
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),
    # OLMo 3: OLMo 2's with a window on some layers (and a RoPE table by kind of layer)
    "olmo3_window": (
        Olmo3Config,
        Olmo3ForCausalLM,
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # EXAONE 4: OLMo 2's norms of the outputs, norms of each head, no RoPE on its full layers beside sliding ones
    "exaone4_window": (
        Exaone4Config,
        Exaone4ForCausalLM,
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 32},
    ),
    # Starcoder2: LayerNorms with biases, an MLP without a gate (c_fc, GELU, c_proj), biases on every linear, a
    # window on every layer
    "starcoder2_window": (Starcoder2Config, Starcoder2ForCausalLM, {"sliding_window": 16}),
    # Phi-4-mini: a rotary embedding over the first 3/4 of each head, LongRoPE (within its original length here:
    # the short factors, scaled; tests/unit/test_fast_llama.py has the long ones)
    "phi4_mini_longrope": (Phi3Config, Phi3ForCausalLM, {**LONGROPE, "original_max_position_embeddings": 256}),
    # GLM (GLM-4-9B-chat-hf): RoPE by neighbouring pairs over half of each head, q/k/v biases, gate/up one linear;
    # GLM-4 (GLM-4-9B/32B-0414): with norms of attention's and the MLP's outputs too
    "glm": (GlmConfig, GlmForCausalLM, {"attention_bias": True}),
    "glm4": (Glm4Config, Glm4ForCausalLM, {"attention_bias": True}),
}
# gpt-oss's RoPE: YaRN over a short original context, its correction range not truncated
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0}
YARN.update({"original_max_position_embeddings": 64, "truncate": False})
# mixtures of experts (the model's own block in each MoE layer: `layout_variants.moe_block`): Mixtral's top 2 of
# 4 experts; Qwen2-MoE's top 2 of 4 beside a gated shared expert, its second layer dense (`mlp_only_layers`);
# Qwen3-MoE's top 2 of 8, their weights renormalized, with Qwen3's head norms
MOE_ARCHS = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe_shared": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
        },
    ),
    # GLM-4.5's: RoPE by halves over half of each head, q/k/v biases, norms of each head (`use_qk_norm`), a dense
    # first layer, then top 2 of 8 experts by sigmoid scores within the best of 2 groups, scaled, and a shared expert
    "glm4_moe": (
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "use_qk_norm": True,
            "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    # OLMoE's: norms of the whole q and k projections (OLMo 2's, with Llama's norms before attention and the MLP),
    # top 2 of 8 experts, their weights not renormalized
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}),
    # gpt-oss's: a sink logit a head in every softmax (random here, so that they change the scores), q/k/v/o biases,
    # sliding layers (a window of 8) beside full ones, YaRN RoPE, top 2 of 4 experts with biases and clamped SwiGLU
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": YARN,
        },
    ),
}
ARCHS.update(MOE_ARCHS)
PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you",
    "Deep learning is a subfield of",
    "Numbers like 1, 2, 3",
    "naïve café",
]


def build(config_cls, model_cls, extra: dict, seed: int = 7):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**copy.deepcopy({**COMMON, **extra}))).eval()  # (transformers edits its dicts)
    kind = model.config.model_type
    with torch.no_grad():  # the heads' norms (Qwen3's) start at ones, biases and Gemma's norms at zeros: values
        for name, weight in model.named_parameters():
            if kind.startswith("gemma") and name.endswith("norm.weight"):  # (scaling by 1 + w)
                weight.uniform_(-0.5, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")) or (
                kind in ("olmo2", "olmo3", "olmoe", "exaone4", "starcoder2", "glm4") and name.endswith("norm.weight")
            ):
                weight.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_proj_bias")):  # (gpt-oss's experts' biases too)
                weight.uniform_(-0.5, 0.5)
            elif name.endswith(".sinks"):  # (gpt-oss's: large enough to take much of each row's weight)
                weight.uniform_(-1.0, 3.0)
        for name, buffer in model.named_buffers():  # (GLM-4.5's router: a bias on each expert's score in choosing)
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.5, 0.5)
    return model


def generic_model(arch: str):
    """A tiny random model of an architecture lmiserve's own forward does not cover (the generic path):
    ``phi`` or ``gpt2``, on the tiny tokenizer's 512 words; or ``qwen3`` (which it covers), for the generic
    runner's own tests."""
    if arch == "gpt2":
        torch.manual_seed(7)
        config = GPT2Config(
            vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
        )
        return GPT2LMHeadModel(config).eval()
    return build(*{"qwen3": ARCHS["qwen3"][:2], "phi": (PhiConfig, PhiForCausalLM)}[arch], {})


def greedy_tokens(loaded, prompt: str, tokens: int) -> list[int]:
    ids = torch.tensor([loaded.tokenizer(prompt).input_ids], device=loaded.model.device)
    with torch.inference_mode():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=3,
        )
    return out[0, ids.shape[1] :].tolist()


async def serve_prompts(loaded, config: EngineConfig, tokens: int, details: bool = False):
    engine = create_engine(loaded, config)
    engine.start()

    async def one(i: int, prompt: str):
        await asyncio.sleep(0.01 * i)  # later requests join a running batch
        params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True, decoder_input_details=details)
        return [e async for e in engine.generate(GenerationRequest(prompt, params))]

    try:
        return engine, await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    finally:
        await engine.stop()
