"""transformers' `generate()` on the same dummy gpt-oss shape (fp32, its eager attention with sinks, the same seeded
weights as `load_format=dummy`): 32 greedy tokens after a short prompt, at batch 1 and 4 (static batches).

    .venv/bin/python benchmarks/results/issue39-gpt-oss-2026-12-02/generate_baseline.py DIR
"""
import json, sys, time
import torch
from lmiserve.models.load import load_causal_lm

loaded = load_causal_lm(sys.argv[1], dtype="fp32", device="cpu", load_format="dummy")
model, tok = loaded.model, loaded.tokenizer
for batch in (1, 4):
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog").input_ids] * batch)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=3)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=3)
        wall = time.perf_counter() - start
    print(json.dumps({"batch": batch, "tokens_per_s": round(batch * 32 / wall, 2)}))
