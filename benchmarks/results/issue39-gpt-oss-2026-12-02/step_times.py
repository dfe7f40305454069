"""A decode step's time on the dummy gpt-oss shape (fp32), after a 20-token prompt a row: lmiserve's forward
(`FastLlama`, the torch attention with sinks over the paged blocks) against transformers' forward with its own
cache (its eager attention), at 1 and 4 rows, each the mean of 5 steps after one warm step.

    .venv/bin/python benchmarks/results/issue39-gpt-oss-2026-12-02/step_times.py DIR
"""

import sys
import time

import torch

from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
from lmiserve.engine.model.fast_llama import FastLlama, StepInputs
from lmiserve.models.load import load_causal_lm

loaded = load_causal_lm(sys.argv[1], dtype="fp32", device="cpu", load_format="dummy")
model, config = loaded.model, loaded.model.config
shape = AttentionShape.of(config)
cache = PagedKVCache(config.num_hidden_layers, 64, 16, shape.kv_heads, shape.head_dim, torch.float32, loaded.device)
fast = FastLlama(model, cache, 4096)
tables = [[i * 4, i * 4 + 1] for i in range(4)]
prompt = list(range(5, 25))


def mean_ms(call, n: int = 5) -> float:
    call()
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1000


with torch.inference_mode():
    fast.forward(StepInputs(chunks=[(t, 0, prompt) for t in tables], keep=[19, 39, 59, 79]))
    for rows in (1, 4):
        step = StepInputs(
            decode_ids=[7] * rows, decode_tables=tables[:rows], decode_positions=[20] * rows, keep=list(range(rows))
        )
        ours = mean_ms(lambda step=step: fast.forward(step))
        state = {"past": model(torch.tensor([prompt] * rows), use_cache=True).past_key_values}

        def theirs(rows: int = rows) -> None:
            state["past"] = model(
                torch.full((rows, 1), 7), past_key_values=state["past"], use_cache=True
            ).past_key_values

        reference = mean_ms(theirs)
        print(
            f"rows {rows}: lmiserve's forward {ours:.0f} ms, transformers' {reference:.0f} ms, {reference / ours:.2f}x"
        )
