"""Each rank's weights, in GB of bf16, when lmiserve's tensor parallelism cuts a mixture of experts: the
published configs of four MoE models (their shapes; no weights), made on the meta device and cut by
`lmiserve.engine.model.sharding.shard_model` for rank 0 of 1, 2, 4 and 8 ranks, as a worker cuts its shell.

    python benchmarks/results/issue39-moe-tensor-parallel-2026-12-02/shard_bytes.py
"""

import copy

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, Glm4MoeConfig, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from lmiserve.engine.model.sharding import shard_model, unsplittable_reason

QWEN3 = {"head_dim": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
MODELS = {
    "Qwen3-30B-A3B": Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                    num_key_value_heads=4, moe_intermediate_size=768, num_experts=128,
                                    intermediate_size=6144, **QWEN3),
    "Qwen3-235B-A22B": Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                      num_key_value_heads=4, moe_intermediate_size=1536, num_experts=128,
                                      intermediate_size=12288, **QWEN3),
    "Mixtral-8x7B": MixtralConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                  num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                                  num_experts_per_tok=2, vocab_size=32000),
    "GLM-4.5-Air": Glm4MoeConfig(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                                 num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408,
                                 n_routed_experts=128, n_shared_experts=1, intermediate_size=10944,
                                 first_k_dense_replace=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                                 vocab_size=151552, partial_rotary_factor=0.5, use_qk_norm=False),
    "gpt-oss-120b": GptOssConfig(hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
                                 num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=128,
                                 num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                                 layer_types=["sliding_attention", "full_attention"] * 18),
}  # fmt: skip

print("| model | whole | 2 ranks | 4 ranks | 8 ranks |")
print("|---|---|---|---|---|")
for name, config in MODELS.items():
    cells = []
    for world in (1, 2, 4, 8):
        reason = unsplittable_reason(config, world)  # (a cut edits its model's config: each cuts a copy)
        if reason is not None:
            cells.append(f"refused: {reason}")
            continue
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
        if world > 1:
            shard_model(model, 0, world, None)
        cells.append(f"{sum(p.numel() for p in model.parameters()) * 2 / 1e9:.1f}")
    print(f"| {name} | " + " | ".join(cells) + " |")
