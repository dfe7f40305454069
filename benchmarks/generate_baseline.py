"""transformers' `generate()` on a model directory's dummy weights (fp32, the same seeded weights as lmiserve's
`load_format=dummy`, the model's own attention): 32 greedy tokens after a short prompt, at batch 1 and at a static
batch of 4; one JSON line each. The baseline for an architecture that transformers' forward over the KV blocks
cannot run (Gemma 2's soft-capped attention, gpt-oss's sinks), where `decode_paths.py` has no `generic` path.

    .venv/bin/python benchmarks/generate_baseline.py DIR
"""

import json
import sys
import time

import torch

from lmiserve.models.load import load_causal_lm

loaded = load_causal_lm(sys.argv[1], dtype="fp32", device="cpu", load_format="dummy")
model, tokenizer = loaded.model, loaded.tokenizer
for batch in (1, 4):
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog").input_ids] * batch)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=3)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=3)
        wall = time.perf_counter() - start
    print(json.dumps({"batch": batch, "tokens_per_s": round(batch * 32 / wall, 2)}))
