"""Where a decode step of the CPU MoE shape spends its time: the experts (the model's block) against the whole
fast-forward step, at 1 and 4 rows (random fp32 weights in this folder's config.json: Qwen3-30B-A3B's layer shape,
8 layers, 32 experts, a 32,000-word vocabulary).

    .venv/bin/python benchmarks/results/issue39-moe-fast-path-2026-12-02/experts_share.py
"""
import json, time, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(Path(__file__).parent)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
shape = AttentionShape.of(cfg)
cache = PagedKVCache(cfg.num_hidden_layers, 65, 16, cfg.num_key_value_heads, shape.head_dim, torch.float32, torch.device("cpu"))
fast = FastLlama(model, cache, 1024)
blocks = [moe for moe in (l.moe for l in fast.layers)]
with torch.inference_mode():
    tables = [[i * 4 + j for j in range(4)] for i in range(4)]
    fast.forward(StepInputs(chunks=[(t, 0, list(range(5 + 40 * i, 37 + 40 * i))) for i, t in enumerate(tables)]))
    for rows in (1, 4):
        step = StepInputs(decode_ids=[7 + 100 * r for r in range(rows)], decode_positions=[32] * rows, decode_tables=tables[:rows], keep=list(range(rows)))
        for _ in range(3): fast.forward(step)
        n = 10; t = time.perf_counter()
        for _ in range(n): fast.forward(step)
        whole = (time.perf_counter() - t) / n
        h = torch.randn(1, rows, cfg.hidden_size)
        for _ in range(3): [b(h) for b in blocks]
        t = time.perf_counter()
        for _ in range(n): [b(h) for b in blocks]
        experts = (time.perf_counter() - t) / n
        print(json.dumps({"rows": rows, "step_ms": round(whole * 1e3, 1), "experts_ms": round(experts * 1e3, 1), "share": round(experts / whole, 2)}))
