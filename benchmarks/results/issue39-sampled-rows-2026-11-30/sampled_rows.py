"""What sampling a step's rows costs when the requests sample (temperature, top_p) rather than decode greedily
(issue #39, 2026-11-30): `sample_rows` on [rows, vocab] float32 logits, greedy rows against sampled ones,
and the torch ops it runs (each one a kernel launch on a GPU).

    PYTHONPATH=. python benchmarks/results/issue39-sampled-rows-2026-11-30/sampled_rows.py [--vocab 49152]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner.sampling import make_generator, sample_rows, sampler_row, warp

parser = argparse.ArgumentParser()
parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
parser.add_argument("--rows", default="1,32,128")
parser.add_argument("--repeats", type=int, default=20)
# the logits' spread: 1 (random logits, flat: top_p 0.9 keeps most of the vocabulary) or 4 (peaked, as a
# trained model's next token: top_p 0.9 keeps tens to hundreds of tokens)
parser.add_argument("--scales", default="1,4")
args = parser.parse_args()
torch.set_num_threads(1)
kinds = {
    "greedy": SamplingParams(max_new_tokens=16),
    "temperature 0.7, top_p 0.9": SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9),
    "temperature 1.0": SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.0),
}
print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, vocab {args.vocab}")
for rows, scale in [(int(r), float(s)) for r in args.rows.split(",") for s in args.scales.split(",")]:
    logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0)) * scale
    kept = int((warp(logits[0].clone(), kinds["temperature 0.7, top_p 0.9"]) > float("-inf")).sum())
    print(f"rows {rows}, logits spread {scale}: top_p 0.9 at temperature 0.7 keeps {kept} tokens")
    for name, params in kinds.items():
        specs = [
            sampler_row(params, [1, 2, 3], [4], [0], seed=i, generator=None, device=torch.device("cpu"))
            for i in range(rows)
        ]
        for spec, i in zip(specs, range(rows)):
            if spec.generator is None and params.do_sample:
                spec.generator = make_generator(i, torch.device("cpu"))
        sample_rows(logits, specs)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sample_rows(logits, specs)
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sample_rows(logits, specs)
        ops = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        ms = statistics.median(times) * 1e3
        print(
            f"  {name:28s}: {ms:8.2f} ms a step ({ms / rows * 1e3:7.1f} us a row), "
            f"{len(ops)} top-level torch ops ({len(ops) / rows:.1f} a row)"
        )
