"""Issue #39: penalized rows inside a decode graph. Before, a decode graph's step sampled its penalized rows
(a repetition, presence or frequency penalty: what TGI and LMI clients commonly send) after the replay, with
the eager sampler, from the graph's logits: the host processed those rows and launched their ops, waited for
their tokens (a step with an eager row is never chained from), and the next step could not start on the
device. Now the graph penalizes them from the runner's penalties' book (engine/runner/penalties.py: dense
rows, pinned), marking each row's input token there, and the step's host work is its inputs' fill.

    PYTHONPATH=. python benchmarks/results/issue39-graph-penalties-2026-12-01/graph_penalties.py [--rows 128]

For `--rows` requests of SmolLM2's vocabulary (49,152), contexts of 1,024 tokens (a fifth of them output),
three kinds (greedy with a repetition penalty of 1.1; sampled at temperature 0.7 and top_p 0.9 with it; sampled
with presence and frequency penalties of 0.5), each step one new token a row:

- ``before``: the eager sampler over the rows after the graph (`sample_rows`, a GPU's path forced on this CPU:
  rows at once, the book's dense rows): its aten ops (on a GPU, each a launch outside the graph), the values
  it copies to the device, and its host side alone (`sampling._processed_rows` on torch's ``meta`` device,
  where ops are dispatched and compute nothing; the warpers, the draw and the transfer come on top);
- ``after``: the host's work for the graph (the book's flush up to the input tokens, which takes nothing once
  a graph marked them, and `GraphSampler.fill`), its ops and time; and the graph's pick itself (replayed on
  a GPU, no launch of its own): its ops and the peak bytes it holds a logit beyond the book's rows (as
  `pool_plan.GRAPH_LOGIT_BYTES` reserves: 4 + 32 B), against the same kind's pick without penalties.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "issue39-graph-kinds-2026-12-01"))
sys.path.insert(0, str(HERE.parent / "issue39-penalty-book-2026-12-01"))

from graph_kinds import Tally, measured  # noqa: E402
from machine import write_report  # noqa: E402
from penalty_rows import KINDS, copied, gpu_path, host_side, requests  # noqa: E402

from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import graph_sampling, seeded_draw  # noqa: E402
from lmiserve.engine.runner.graph_sampling import GraphSampler, kind, stages  # noqa: E402
from lmiserve.engine.runner.penalties import PenaltyBook  # noqa: E402
from lmiserve.engine.runner.sampling import sample_rows  # noqa: E402


def before(rows: int, vocab: int, context: int, name: str) -> dict:
    params = KINDS[name]
    rng = random.Random(0)
    specs = requests(rows, vocab, context, params, True, rng)
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1)) * 3

    def step() -> None:
        for spec in specs:
            spec.output_ids.append(rng.randrange(vocab))
        sample_rows(logits, specs)

    step()  # (the prompts marked: once a request)
    counter, tally = [0], Tally()
    with copied(counter), tally:
        step()
    return {
        "ops_outside_the_graph": len(tally.ops),
        "copied_values": counter[0],
        "host_ms_processing_alone": host_side(rows, vocab, context, params, True),
        "host_waits": 1,
    }


def after(rows: int, vocab: int, context: int, name: str) -> dict:
    params = KINDS[name]
    rng = random.Random(0)
    specs = requests(rows, vocab, context, params, True, rng)
    book = specs[0].penalty.book  # type: ignore[union-attr]
    book.pin()
    slots = [spec.penalty.slot for spec in specs]  # type: ignore[union-attr]
    sampler = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
    cpu = torch.device("cpu")

    def fill() -> None:  # the host's work for a step: a token a row in flight, as a chained step has it
        indexes = [len(spec.output_ids) + 1 for spec in specs]
        book.flush(cpu, vocab, slots, [i - 1 for i in indexes])
        sampler.fill([(params, n, indexes[n], slots[n], ()) for n in range(rows)], rows, book)
        book.taken_by_graph(slots)
        for spec in specs:
            spec.output_ids.append(rng.randrange(vocab))

    fill()
    counter, tally = [0], Tally()
    with copied(counter), tally:
        fill()
    inputs = torch.tensor([spec.output_ids[-1] for spec in specs])
    picks = {}
    for chosen in (params, replace(params, top_p=0.9) if params.do_sample else None):
        if chosen is None:
            continue
        sampler.fill([(chosen, n, 3, slots[n], ()) for n in range(rows)], rows, book)
        picks[kind([chosen])] = picked(sampler, chosen, book, inputs)
    return {
        "ops_outside_the_graph": len(tally.ops),
        "copied_values": counter[0] + sum(t.numel() for t in sampler._device),
        "host_ms_fill": round(statistics.median(_seconds(fill) for _ in range(7)) * 1e3, 3),
        "host_waits": 0,
        "picks": picks,
    }


def _seconds(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def picked(sampler: GraphSampler, params: SamplingParams, book: PenaltyBook, inputs: torch.Tensor) -> dict:
    """The graph's pick of `sampler`'s rows (filled with `params`): its ops, time and peak bytes a logit beyond
    the book's rows, against the pick of the same rows without their penalties."""
    rows, vocab = len(inputs), sampler.vocab
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1)) * 3
    filtered = stages(kind([params]))[0]
    plain = GraphSampler(rows, vocab, torch.device("cpu"), pin=False)
    unpenalized = replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    plain.fill([(unpenalized, n, 3, None, ()) for n in range(rows)], rows)
    return {
        "with_penalties": {
            **measured(lambda: sampler.pick(logits, filtered, inputs), rows * vocab, 1),
            "peak_bytes_a_logit": peak(lambda: sampler.pick(logits, filtered, inputs), rows * vocab, book),
        },
        "without": measured(lambda: plain.pick(logits, filtered), rows * vocab, 1),
    }


def peak(call: Callable[[], object], logits: int, book: PenaltyBook) -> float:
    """The peak bytes a logit `call` holds at once beyond the book's rows (which its marks return: they are
    allocated outside the graphs' pool, once for the server, and the start-up profile counts them)."""
    tally = Tally()
    tally._seen.update(t.untyped_storage().data_ptr() for t in (book.seen, book.counts) if t is not None)
    with tally:
        call()
    return round(tally.peak / logits, 1)


def stand_in_draw() -> None:
    """One thread; the draw kernel (one launch in a graph; Triton's interpreter on a CPU) stood in for by an
    argmax, as graph_kinds.py does: its own tensors are a row's few values."""
    torch.set_num_threads(1)
    seeded_draw.draw_keyed = lambda probs, keys, index: (probs.argmax(-1), torch.zeros(len(probs), dtype=torch.bool))
    seeded_draw.usable = lambda device: True  # (the eager sampler's draw too: one kernel on a GPU)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stand_in_draw()
    results = []
    with gpu_path():
        for name in KINDS:
            entry = {
                "kind": name,
                "before": before(args.rows, args.vocab, args.context, name),
                "after": after(args.rows, args.vocab, args.context, name),
            }
            print(json.dumps(entry), flush=True)
            results.append(entry)
    write_report(
        args.out,
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        rows=args.rows,
        vocab=args.vocab,
        context=args.context,
        penalties_in_graphs=graph_sampling.PENALTIES_IN_GRAPHS,
        results=results,
    )


if __name__ == "__main__":
    main()
