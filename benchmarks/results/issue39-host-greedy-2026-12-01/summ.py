"""The ABBA runs of abba.sh side by side: each span's CPU ms a step per run, the medians and their ratio."""

import glob
import json
import statistics
import sys

SPANS = ["plan", "batch update", "inputs", "metadata", "model", "sampling", "update", "deliver", "event loop"]


def runs(folder: str, side: str) -> list[dict]:
    found = []
    for path in sorted(glob.glob(f"{folder}/{side}-*/summary.json")):
        with open(path) as summary:
            found.append(json.load(summary)["results"][0])
    return found


def value(run: dict, span: str) -> float:
    cpu = run["cpu_ms"]
    return sum(cpu[s] for s in SPANS if s != "model") if span == "host sum" else cpu[span]


def main() -> None:
    a, b = runs(sys.argv[1], "A"), runs(sys.argv[1], "B")
    names = [f"A{i}" for i in range(len(a))] + [f"B{i}" for i in range(len(b))]
    print("span | " + " | ".join(names) + " | median A | median B | A/B")
    for span in [*SPANS, "host sum"]:
        va, vb = [value(r, span) for r in a], [value(r, span) for r in b]
        ma, mb = statistics.median(va), statistics.median(vb)
        cells = " | ".join(f"{x:.3f}" for x in va + vb)
        print(f"{span} | {cells} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f}")
    for side, found in (("A", a), ("B", b)):
        periods = [round(r["ms"]["period"], 3) for r in found]
        print(side, "period ms", periods, "tok/s", [r["tokens_per_s"] for r in found])


if __name__ == "__main__":
    main()
