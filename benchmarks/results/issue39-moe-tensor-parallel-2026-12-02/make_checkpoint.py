"""A safetensors checkpoint of `config.json` (Qwen3-30B-A3B's layer shape, cut: see README.md) with random weights,
saved as published MoE checkpoints are (one matrix per expert, bf16, several files), with the word-level
tokenizer of benchmarks/gpu_check.py's model directories.

    python benchmarks/results/issue39-moe-tensor-parallel-2026-12-02/make_checkpoint.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import gpu_check  # noqa: E402

out = Path(sys.argv[1])
gpu_check.SHAPES["moe-tp"] = json.loads((HERE / "config.json").read_text())
gpu_check.dummy_model_dir("moe-tp", out)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
model.save_pretrained(out, max_shard_size="1GB")
print(sorted(p.name for p in out.iterdir()))
