"""Inclusive shares of a py-spy raw profile (``-f raw``: a line a stack, ``frame;frame;... count``): the
threads' shares, then each function's share of the samples whose stack holds it (once a stack).

    python3 summarize.py engine-process.raw.txt
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def main(path: str) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        samples = int(count)
        total += samples
        frames = stack.split(";")
        threads[frames[0][:60]] += samples
        for name in {frame.split(" (")[0] for frame in frames}:
            inclusive[name] += samples
    print("total", total)
    for thread, samples in threads.most_common(8):
        print(f"{samples / total:6.1%} {thread}")
    print("--- inclusive top")
    for name, samples in inclusive.most_common(70):
        print(f"{samples / total:6.1%} {name}")


if __name__ == "__main__":
    main(sys.argv[1])
