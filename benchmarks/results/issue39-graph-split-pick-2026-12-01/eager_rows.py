"""Issue #39: what a decode step of 128 rows does outside its graph when one row asks for what the graph's
pick did not give: its top 5 tokens (OpenAI's ``top_logprobs``, TGI's ``top_n_tokens``), or a repetition
penalty, which a graph does not sample. Before this change every row of such a step went to the eager sampler
(`sample_rows`) and the graph's pick was dropped. Now the graph's pick serves every row it can
(engine/runner/persistent_batch.py, `_graph_served`): a top-N row's tokens go with the pick
(`graph_sampling.with_top_n`, on the device, no wait), and a penalty row alone goes to the eager sampler.

    PYTHONPATH=. python benchmarks/results/issue39-graph-split-pick-2026-12-01/eager_rows.py [--rows 128] [--vocab 8192]

For each step, the work outside the graph before and after (the rows' `Row`s made, `sampler_row`, and
`sample_rows` over them; or `with_top_n`), on a GPU's path (the rows at once, `sampling._at_once`), on a CPU
with one thread over random logits: the aten ops it dispatches (on a GPU each a kernel launch outside the
graph), the sorts and top-ks among them, the peak bytes a logit of the tensors it holds at once, whether it
waits for the step (the eager sampler's one transfer does), and its CPU time (the median of 5).
The graph's own pick (one replay on a GPU) is tallied apart. The vocabulary is 8,192 by default: past that
a CPU's top_p goes row by row (engine/runner/warpers.py), where a GPU's sorts the rows at once; the ops do
not depend on the vocabulary's size on the GPU's path, the bytes scale with it. The draw kernel is Triton's
on a GPU: here a stand-in of one op, as in issue39-graph-kinds-2026-12-01.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "issue39-graph-kinds-2026-12-01"))

from graph_kinds import measured  # noqa: E402
from machine import run_facts  # noqa: E402

from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import sampling, seeded_draw  # noqa: E402
from lmiserve.engine.runner.graph_sampling import GraphSampler, in_graph, kind, with_top_n  # noqa: E402
from lmiserve.engine.runner.sampling import greedy_pick, sample_rows, sampler_row  # noqa: E402


def tally(call: Callable[[], object], logits_of: int) -> dict:
    return measured(call, logits_of, 2)


def eager(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """What the runner does for the rows the eager sampler takes: a `Row` each, then `sample_rows` (whose one
    transfer to the host waits for the step)."""
    prompt, output = list(range(100, 160)), list(range(200, 220))
    rows = [sampler_row(p, prompt, output, [2], 7 + n, None, logits.device) for n, p in enumerate(params)]
    for result in sample_rows(logits, rows):
        assert not isinstance(result, Exception), result


def step(rows: int, vocab: int, odd: SamplingParams, others: SamplingParams) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    params = [odd] + [others] * (rows - 1)
    every = rows * vocab  # (bytes a logit of the step's: rows x vocabulary)
    sampled = others.do_sample
    if sampled:  # the graph samples the others (the odd row is greedy to it)
        sampler = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
        sampler.fill([(SamplingParams(), None, 0, None, ())] + [(others, 7 + n, 20, None, ()) for n in range(1, rows)], rows)
        filtered = kind(params) == "sampled-filtered"
        pick: Callable[[], torch.Tensor] = lambda: sampler.pick(logits, filtered)  # noqa: E731
    else:
        pick = lambda: greedy_pick(logits)  # noqa: E731
    graph = tally(pick, every)
    if in_graph(odd):  # the top-N go with the graph's pick
        picked = pick()
        after = tally(lambda: with_top_n(picked, logits, odd.top_n_tokens), every)
        after["what"] = "with_top_n on the graph's logits (no eager sampler, no wait: the step may chain)"
    else:
        after = tally(lambda: eager(logits[[0]], params[:1]), every)
        after["what"] = "the eager sampler over the odd row alone (its transfer waits for the step)"
    before = tally(lambda: eager(logits, params), every)
    before["what"] = "the eager sampler over every row (its transfer waits for the step)"
    return {"before": before, "after": after, "graph's pick (inside the graph)": graph}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling._at_once = lambda device: True  # the GPU's path
    stand_in = lambda probs, keys, index: (probs.argmax(-1), torch.zeros(len(probs), dtype=torch.bool))  # noqa: E731
    seeded_draw.draw_keyed = stand_in
    seeded_draw.usable = lambda device: True
    greedy = SamplingParams(max_new_tokens=64)
    sampled = SamplingParams(max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.9, seed=1)
    top_n = SamplingParams(max_new_tokens=64, top_n_tokens=5)
    penalty = SamplingParams(max_new_tokens=64, repetition_penalty=1.2)
    report = {
        **run_facts(),
        "rows": args.rows,
        "vocab": args.vocab,
        "a top-5 row, the others greedy": step(args.rows, args.vocab, top_n, greedy),
        "a top-5 row, the others sampled (temperature 0.8, top_p 0.9)": step(args.rows, args.vocab, top_n, sampled),
        "a penalty row (1.2), the others sampled": step(args.rows, args.vocab, penalty, sampled),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
