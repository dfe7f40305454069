"""Each rank's weights, in GB, when lmiserve's tensor parallelism cuts an fp8 checkpoint: the published configs of
three dense models (their shapes; no weights), made on the meta device and cut by
`lmiserve.engine.model.sharding.shard_model` for rank 0 of 1, 2, 4 and 8 ranks, as a worker cuts its shell; then
counted as a rank holds them on a GPU that multiplies fp8 (Hopper, Ada): each linear of the layers an `Fp8Linear`
(one byte a weight and a fp32 scale a row, `shard_quantized.shard_linear`), the rest (embeddings, norms) bf16; and
as bf16 (a float checkpoint; AWQ/GPTQ and block-wise fp8 on a GPU today, dequantized at load).

    python benchmarks/results/issue39-quantized-tensor-parallel-2026-12-02/shard_bytes.py
"""

import copy

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lmiserve.engine.model.sharding import shard_model

LLAMA31 = {"vocab_size": 128256, "num_key_value_heads": 8, "tie_word_embeddings": False}
MODELS = {
    "Llama-3.1-70B": LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, **LLAMA31),
    "Llama-3.1-405B": LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                  num_attention_heads=128, **LLAMA31),
    "Qwen2.5-72B": Qwen2Config(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                               tie_word_embeddings=False),
}  # fmt: skip


def rank_bytes(model: torch.nn.Module) -> tuple[float, float]:
    """(fp8 linears, bf16 rest) and all bf16, in GB, of `model`'s parameters as cut."""
    fp8 = bf16 = 0
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and ".layers." in name:
            out, inputs = module.weight.shape
            fp8 += out * inputs + 4 * out
    linear = sum(m.weight.numel() for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".layers." in n)
    bf16 = sum(p.numel() for p in model.parameters()) * 2
    return (fp8 + bf16 - 2 * linear) / 1e9, bf16 / 1e9


print("| model | format | whole | 2 ranks | 4 ranks | 8 ranks |")
print("|---|---|---|---|---|---|")
for name, config in MODELS.items():
    rows: dict[str, list[str]] = {"fp8 (Fp8Linear)": [], "bf16": []}
    for world in (1, 2, 4, 8):
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
        if world > 1:
            shard_model(model, 0, world, None)
        fp8, bf16 = rank_bytes(model)
        rows["fp8 (Fp8Linear)"].append(f"{fp8:.1f}")
        rows["bf16"].append(f"{bf16:.1f}")
    for fmt, cells in rows.items():
        print(f"| {name} | {fmt} | " + " | ".join(cells) + " |")
