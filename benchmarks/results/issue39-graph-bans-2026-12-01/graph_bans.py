"""Issue #39: `min_new_tokens` inside a decode graph. Benchmark clients force N tokens with vLLM's
``min_tokens = max_tokens = N`` and ``ignore_eos`` (genai-perf's fixed output lengths, and lmiserve bench's
own OpenAI dialects, lmiserve/bench/clients.py and chat.py). Until now such a row never sampled in a decode
graph: the graph's step left it to the eager sampler after the replay, which processed it (its EOS and stop
ids banned), launched its ops, waited for its token, and the step could not chain into the next one on the
device. Every row of such a benchmark, so every step. Now the graph bans those ids from buffers the host fills
(`GraphSampler.fill`: up to `GRAPH_BANNED` ids a row), and the step's host work is that fill.

    PYTHONPATH=. python benchmarks/results/issue39-graph-bans-2026-12-01/graph_bans.py [--rows 128] [--out F]

For `--rows` requests of SmolLM2's vocabulary (49,152), 2 EOS ids (as SmolLM2-Instruct's generation config
has), greedy and sampled (temperature 0.7: no top_p, whose eager path on a CPU goes row by row, not a GPU's),
each with ``min_new_tokens`` not reached yet:

- ``before``: the eager sampler over the rows after the graph (`sample_rows`, a GPU's path forced on this CPU:
  rows at once): its aten ops (on a GPU, each a launch outside the graph), the values it copies to the
  device, and its host side alone (`sampling._processed_rows` on torch's ``meta`` device, where ops are
  dispatched and compute nothing; the warpers, the draw and the transfer come on top);
- ``after``: the host's work for the graph (`GraphSampler.fill`), its ops and time.
- ``picks``: the graph's pick of every sampled kind (replayed on a GPU: no launch of its own), its aten ops
  and the peak bytes it holds a logit beyond the book's rows (`pool_plan.GRAPH_LOGIT_BYTES` reserves 32 B).
  Run with the tree
  before this change (a copy of this script in its worktree, ``--picks-only``) for the pick without the ban's
  stage.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(HERE.parent / "issue39-graph-kinds-2026-12-01"))
sys.path.insert(0, str(HERE.parent / "issue39-penalty-book-2026-12-01"))
sys.path.insert(0, str(HERE.parent / "issue39-graph-penalties-2026-12-01"))

from graph_kinds import Tally, measured  # noqa: E402
from graph_penalties import peak, stand_in_draw  # noqa: E402
from machine import write_report  # noqa: E402
from penalty_rows import copied, gpu_path, timed  # noqa: E402

from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import graph_sampling, sampling  # noqa: E402
from lmiserve.engine.runner.graph_sampling import GraphSampler, kind, stages  # noqa: E402
from lmiserve.engine.runner.penalties import PenaltyBook  # noqa: E402
from lmiserve.engine.runner.sampling import sample_rows, sampler_row  # noqa: E402

EOS = [0, 2]
KINDS = {
    "greedy, min_tokens": SamplingParams(min_new_tokens=128, max_new_tokens=128, ignore_eos_token=True),
    "sampled T 0.7, min_tokens": SamplingParams(
        do_sample=True, temperature=0.7, min_new_tokens=128, max_new_tokens=128, ignore_eos_token=True
    ),
}
BANS = len(graph_sampling.GraphRow.__args__) == 5  # (the tree of this change: rows carry their ids)


def _row(params: SamplingParams, seed: int, index: int, slot: int | None, banned: list[int]) -> tuple:
    return (params, seed, index, slot, banned) if BANS else (params, seed, index, slot)


def _specs(rows: int, vocab: int, params: SamplingParams, device: str = "cpu") -> list[sampling.Row]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(200)] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(20)] for _ in range(rows)]
    return [sampler_row(params, prompts[n], outputs[n], EOS, n, None, torch.device(device)) for n in range(rows)]


def before(rows: int, vocab: int, name: str) -> dict:
    params = KINDS[name]
    specs = _specs(rows, vocab, params)
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1)) * 3
    sample_rows(logits, specs)
    counter, tally = [0], Tally()
    with copied(counter), tally:
        sample_rows(logits, specs)
    meta, where = torch.empty((rows, vocab), device="meta"), list(range(rows))
    return {
        "ops_outside_the_graph": len(tally.ops),
        "copied_values": counter[0],
        "host_ms_processing_alone": timed(lambda: sampling._processed_rows(meta, specs, where), 3),
        "host_waits": 1,
    }


def after(rows: int, vocab: int, name: str) -> dict:
    params = KINDS[name]
    sampler = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
    banned = EOS + params.stop_token_ids

    def fill() -> None:  # the host's work for a step: a token a row in flight, as a chained step has it
        sampler.fill([_row(params, n, 21, None, banned) for n in range(rows)], rows)

    fill()
    tally = Tally()
    with tally:
        fill()
    return {
        "ops_outside_the_graph": len(tally.ops),
        "copied_values": sum(t.numel() for t in sampler._device),
        "host_ms_fill": timed(fill, 3),
        "host_waits": 0,
    }


def picks(rows: int, vocab: int) -> dict:
    """Each sampled kind's pick (with and without a repetition penalty), its rows banning where the tree
    bans: aten ops, CPU ms and peak bytes a logit."""
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1)) * 3
    base = KINDS["sampled T 0.7, min_tokens"]
    out = {}
    for params in (base, replace(base, top_p=0.9)):
        for penalty in (1.0, 1.1):
            chosen = replace(params, repetition_penalty=penalty)
            sampler = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
            book, inputs, slot = None, None, None
            if penalty != 1.0:
                book = PenaltyBook()
                book.pin(rows)
                slot = book.open([1, 2, 3], [4])
                book.flush(torch.device("cpu"), vocab, [slot], [0])
                inputs = torch.zeros(rows, dtype=torch.int64)
            sampler.fill([_row(chosen, n, 21, slot, EOS) for n in range(rows)], rows, book)
            pick = functools.partial(sampler.pick, logits, stages(kind([chosen]))[0], inputs)
            out[kind([chosen])] = measured(pick, rows * vocab, 1)
            if book is not None:  # (beyond the book's rows, which its marks return: allocated once, outside)
                out[kind([chosen])]["peak_bytes_a_logit"] = peak(pick, rows * vocab, book)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--picks-only", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stand_in_draw()
    results = []
    with gpu_path():
        if not args.picks_only:
            for name in KINDS:
                entry = {"kind": name, "before": before(args.rows, args.vocab, name)}
                entry["after"] = after(args.rows, args.vocab, name)
                print(json.dumps(entry), flush=True)
                results.append(entry)
        pick = picks(args.rows, args.vocab)
        print(json.dumps(pick), flush=True)
    write_report(
        args.out,
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        rows=args.rows,
        vocab=args.vocab,
        bans_in_graphs=BANS,
        tree=str(Path(graph_sampling.__file__).parents[3]),
        results=results,
        picks=pick,
    )


if __name__ == "__main__":
    main()
