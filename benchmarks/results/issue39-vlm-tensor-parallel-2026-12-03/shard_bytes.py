"""Each rank's weights, in GB of bf16, when lmiserve's tensor parallelism serves a vision-language model: the decoder
and output projection cut as a text model's, the vision tower and projector whole on every rank. The published
shapes of Qwen2.5-VL-72B-Instruct and Gemma-3-27B-it (their configs' numbers; no weights), made on the meta device
and cut by `lmiserve.engine.model.sharding.shard_model` for rank 0 of 1, 2, 4 and 8 ranks, as a worker cuts its shell
(Gemma 3's output projection is its embedding, as its config says).

    python benchmarks/results/issue39-vlm-tensor-parallel-2026-12-03/shard_bytes.py
"""

import copy

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForImageTextToText, Gemma3Config, Qwen2_5_VLConfig

from lmiserve.engine.model.language_model import language_model
from lmiserve.engine.model.sharding import shard_model

MODELS = {
    "Qwen2.5-VL-72B-Instruct": Qwen2_5_VLConfig(
        text_config={"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                     "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                     "tie_word_embeddings": False, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3456, "num_heads": 16,
                       "out_hidden_size": 8192, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
        tie_word_embeddings=False,
    ),
    "Gemma-3-27B-it": Gemma3Config(
        text_config={"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                     "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208},
        vision_config={"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
        mm_tokens_per_image=256,
    ),
}  # fmt: skip


def gigabytes(module: torch.nn.Module, skip: set[int] = frozenset()) -> float:  # type: ignore[assignment]
    return sum(p.numel() * 2 for p in module.parameters() if id(p) not in skip) / 1e9


print("| model | part | whole | 2 ranks | 4 ranks | 8 ranks |")
print("|---|---|---|---|---|---|")
for name, config in MODELS.items():
    rows: dict[str, list[str]] = {"decoder and head (split)": [], "vision tower and projector (whole)": [], "a rank": []}
    for world in (1, 2, 4, 8):
        with init_empty_weights(include_buffers=False):
            model = AutoModelForImageTextToText.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
        shard_model(model, 0, world, None)  # (at 1: the model whole, its output projection tied as its config says)
        view = language_model(model)
        assert view is not None
        split = {id(p) for m in (view.model, view.lm_head) for p in m.parameters()}
        total = gigabytes(model)
        decoder = total - gigabytes(model, split)
        rows["decoder and head (split)"].append(f"{decoder:.2f}")
        rows["vision tower and projector (whole)"].append(f"{total - decoder:.2f}")
        rows["a rank"].append(f"{total:.2f}")
    for part, cells in rows.items():
        print(f"| {name} | {part} | " + " | ".join(cells) + " |")
