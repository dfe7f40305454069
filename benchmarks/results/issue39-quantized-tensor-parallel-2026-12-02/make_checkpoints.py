"""Three checkpoints of `config.json` (Llama-3.2-1B's layer shape cut to 6 layers and a 32,000-word vocabulary: see
README.md) from one set of random weights: ``float`` (bf16, as saved by transformers), ``awq`` (4-bit AWQ GEMM,
groups of 128) and ``fp8`` (compressed-tensors fp8 per output channel), written by `lmiserve.models.quant_pack`
as the published formats store them, each with the word-level tokenizer of benchmarks/gpu_check.py's model
directories.

    python benchmarks/results/issue39-quantized-tensor-parallel-2026-12-02/make_checkpoints.py OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lmiserve.models.quant_pack import write_quantized

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import gpu_check  # noqa: E402

out = Path(sys.argv[1])
gpu_check.SHAPES["llama-6l"] = json.loads((HERE / "config.json").read_text())
shell = gpu_check.dummy_model_dir("llama-6l", out / "float")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shell), dtype=torch.float32)
with torch.no_grad():  # wider than the init's 0.02: peaked logits, so greedy tokens are not near ties
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.05)
model.to(torch.bfloat16).save_pretrained(out / "float")
for name, fmt in (("awq", "awq"), ("fp8", "fp8-channel")):
    write_quantized(model.float(), out / name, fmt, group=128)
    for file in (out / "float").iterdir():  # the tokenizer and generation config
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / name / file.name)
print({d.name: sorted(p.name for p in d.iterdir()) for d in out.iterdir()})
