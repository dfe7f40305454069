"""Issue #39: what a step's penalties cost the host, before and after the penalties' book
(engine/runner/penalties.py). Before, each step each penalized row gave the (row, token) pairs of its tokens
from the request's lists: a Python set of its prompt and output, sorted, then those ids and as many penalty
values copied to the device, so the step's host time and its copy grew with every row's context. Now a
runner keeps a penalized request's tokens in a book, taken once for the prompt, then by each step's new
tokens: on a GPU as dense device rows (a step's penalties are a few ops over its rows, whatever their
contexts), on a CPU as each request's distinct tokens and counts in host arrays (indexed in place).

    PYTHONPATH=. python benchmarks/results/issue39-penalty-book-2026-12-01/penalty_rows.py [--rows 128] [--vocab 49152]

For 128 rows of SmolLM2's vocabulary (49,152) and contexts of 256, 1,024 and 4,096 tokens (a fifth of them
output), each step one new token a row (as a decode step adds), `sample_rows` over the rows, three kinds:
greedy with a repetition penalty of 1.1 (TGI's and LMI's common setting), and sampled at temperature 0.7 with
it, or with OpenAI's presence and frequency penalties (0.5 each). Two paths:

- ``cpu``: this CPU's own (a row at a time; the sampled rows over two threads; the book's marks on the host);
- ``gpu-path``: a GPU's (the rows at once, `sampling._at_once`; the book's rows whole, `penalties._dense`),
  run on this CPU with one thread: its aten ops (on a GPU each a kernel launch) and the values it copies to
  the device each step (`host_copy.to_device`), which do not depend on the device. Its CPU time is the host
  side only where the device is a GPU; here it includes the ops themselves. So the host side alone of the
  rows' processing (`sampling._processed_rows`: the bias, the penalties, the bans) is timed on torch's
  ``meta`` device too, where an op is dispatched and computes nothing, as on a GPU that keeps up
  (``gpu_path_host_ms``; on a real GPU add the launches' own cost).

Each time is the median of 7 steps' wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "issue39-graph-kinds-2026-12-01"))

from graph_kinds import Tally  # noqa: E402
from machine import write_report  # noqa: E402

from lmiserve.core.request import SamplingParams  # noqa: E402
from lmiserve.engine.runner import penalties, sampling  # noqa: E402
from lmiserve.engine.runner.penalties import BookedRow, PenaltyBook  # noqa: E402
from lmiserve.engine.runner.sampling import Row, sample_rows  # noqa: E402

KINDS = {
    "greedy, repetition 1.1": SamplingParams(repetition_penalty=1.1),
    "sampled, repetition 1.1": SamplingParams(do_sample=True, temperature=0.7, repetition_penalty=1.1),
    "sampled, presence+frequency 0.5": SamplingParams(
        do_sample=True, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5
    ),
}


@contextmanager
def gpu_path() -> Iterator[None]:
    """A GPU's path on this CPU: the rows at once, the book's rows whole."""
    at_once, dense = sampling._at_once, penalties._dense
    sampling._at_once = penalties._dense = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        sampling._at_once, penalties._dense = at_once, dense  # type: ignore[assignment]


@contextmanager
def copied(counter: list[int]) -> Iterator[None]:
    """Counts the values copied to the device (`to_device`, as both modules call it)."""
    originals = (sampling.to_device, penalties.to_device)

    def counting(values, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counter[0] += len(values)
        return originals[0](values, *args, **kwargs)

    sampling.to_device = penalties.to_device = counting  # type: ignore[assignment]
    try:
        yield
    finally:
        sampling.to_device, penalties.to_device = originals  # type: ignore[assignment]


def requests(
    rows: int, vocab: int, context: int, params: SamplingParams, booked: bool, rng: random.Random
) -> list[Row]:
    """`rows` requests of `context` tokens (a fifth of them output, drawn from `rng`), in one book where
    `booked`."""
    output = context // 5
    book = PenaltyBook()
    specs = []
    for n in range(rows):
        spec = Row(
            params,
            [rng.randrange(vocab) for _ in range(context - output)],
            [rng.randrange(vocab) for _ in range(output)],
            [],
            torch.Generator().manual_seed(n) if params.do_sample else None,
            seed=n if params.do_sample else None,
        )
        if booked:
            spec.penalty = BookedRow(book, book.open(spec.prompt_ids, spec.output_ids))
        specs.append(spec)
    return specs


def stepping(
    specs: list[Row],
    vocab: int,
    logits: torch.Tensor,
    sample: Callable[[torch.Tensor, list[Row]], object],
    rng: random.Random,
) -> Callable[[], None]:
    """A step over `specs`: a token drawn from `rng` added a row, then `sample` over them; run once (the book's
    prompts marked: once a request)."""

    def step() -> None:
        for spec in specs:
            spec.output_ids.append(rng.randrange(vocab))
        sample(logits, specs)

    step()
    return step


def sampled(logits: torch.Tensor, specs: list[Row]) -> None:
    for result in sample_rows(logits, specs):
        assert not isinstance(result, Exception), result


def steps(rows: int, vocab: int, context: int, params: SamplingParams, booked: bool) -> Callable[[], None]:
    """A step's `sample_rows` over `rows` requests of `context` tokens; each call adds a token a row first."""
    rng = random.Random(0)
    logits = torch.randn((rows, vocab), generator=torch.Generator().manual_seed(1)) * 3
    return stepping(requests(rows, vocab, context, params, booked, rng), vocab, logits, sampled, rng)


def host_side(rows: int, vocab: int, context: int, params: SamplingParams, booked: bool) -> float:
    """The same requests processed on the ``meta`` device: the host's side of the processing alone."""
    logits = torch.empty((rows, vocab), device="meta")
    process = stepping(
        requests(rows, vocab, context, params, booked, random.Random(0)),
        vocab,
        logits,
        lambda logits, specs: sampling._processed_rows(logits, specs, list(range(rows))),
        random.Random(1),
    )
    return timed(process)


def timed(step: Callable[[], object], digits: int = 1) -> float:
    """The median of 7 runs of `step`, in ms to `digits` places."""
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, digits)


def measure(rows: int, vocab: int, contexts: list[int]) -> list[dict]:
    out = []
    for name, params in KINDS.items():
        for context in contexts:
            entry: dict = {"kind": name, "context": context}
            for booked in (False, True):
                side = "after" if booked else "before"
                torch.set_num_threads(2)
                entry[f"cpu_ms_{side}"] = timed(steps(rows, vocab, context, params, booked))
                torch.set_num_threads(1)
                with gpu_path():
                    step = steps(rows, vocab, context, params, booked)
                    counter = [0]
                    tally = Tally()
                    with copied(counter), tally:
                        step()
                    entry[f"gpu_path_ops_{side}"] = len(tally.ops)
                    entry[f"gpu_path_copied_values_{side}"] = counter[0]
                    entry[f"gpu_path_cpu_ms_{side}"] = timed(step)
                    entry[f"gpu_path_host_ms_{side}"] = host_side(rows, vocab, context, params, booked)
            out.append(entry)
            print(json.dumps(entry), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = measure(args.rows, args.vocab, [int(c) for c in args.contexts.split(",")])
    write_report(args.out, rows=args.rows, vocab=args.vocab, results=results)


if __name__ == "__main__":
    main()
