"""CPU seconds of each server process per generated token, per concurrency, ABBA order: robust to a busy
neighbour (what the wall-clock rate is not). Usage: cpu_per_token.py before_port after_port [levels [rounds]]
(both servers started with `lmiserve serve --port ...`; run from the repository root)."""

import json
import os
import re
import subprocess
import sys
import urllib.request


def pid_of(port):
    out = subprocess.run(["pgrep", "-f", f"serve --port {port}"], capture_output=True, text=True).stdout.split()
    return int(out[0])


def cpu(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def tokens(port):
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics").read().decode()
    found = re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0  # none generated yet


ports = {"before": int(sys.argv[1]), "after": int(sys.argv[2])}
LEVELS = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,8,32").split(",")]
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 1
pids = {k: pid_of(p) for k, p in ports.items()}
results = {}
for level in LEVELS:
    for name in ("before", "after", "after", "before") * ROUNDS:
        port, pid = ports[name], pids[name]
        c0, t0 = cpu(pid), tokens(port)
        out = subprocess.run(
            [
                ".venv/bin/lmiserve",
                "bench",
                "--url",
                f"http://localhost:{port}",
                "--compare-url",
                f"http://localhost:{port}",
                "--compare-name",
                f"{name}-openai",
                "--concurrency",
                str(level),
                "--duration",
                "15",
                "--skip-baselines",
                "--output-dir",
                f"/tmp/cpt/{name}-{level}",
            ],
            capture_output=True,
            text=True,
        )
        c1, t1 = cpu(pid), tokens(port)
        rates = re.findall(r"concurrency +\d+ \[(\S+)\]: ([0-9.]+) tokens/s", out.stdout + out.stderr)
        results.setdefault(str(level), {}).setdefault(name, []).append(
            {"cpu_s": c1 - c0, "tokens": t1 - t0, "ms_cpu_per_token": 1000 * (c1 - c0) / (t1 - t0), "tok_s": rates}
        )
        print(level, name, round(1000 * (c1 - c0) / (t1 - t0), 3), "ms CPU/token", rates, flush=True)
with open(os.environ.get("CPT_OUT", "cpu_per_token.json"), "w") as sink:
    json.dump(results, sink, indent=1)
for level, by in results.items():
    b = sum(r["cpu_s"] for r in by["before"]) / sum(r["tokens"] for r in by["before"])
    a = sum(r["cpu_s"] for r in by["after"]) / sum(r["tokens"] for r in by["after"])
    print(
        f"concurrency {level}: CPU per token before {1000 * b:.3f} ms, after {1000 * a:.3f} ms,",
        f"before/after {b / a:.3f}",
    )
