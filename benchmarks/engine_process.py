"""The engine core in the server's process or in its own (`engine_process`), at many streams: tokens/s and the
CPU each process spends a streamed token, the two servers measured in turns (ABBA) in one run.

    .venv/bin/python benchmarks/engine_process.py --model-id DIR [--concurrency 128] [--tokens 128]
        [--requests-per-client 2] [--rounds 2] [--client-processes N] [-o KEY=VALUE ...] [--json FILE]

Starts `lmiserve serve` twice on `--model-id` (the same options, `max_rolling_batch_size` = the largest
concurrency; one with `engine_process=true`), then per level and round runs `lmiserve bench --url ...
--skip-baselines` against each in ABBA order. The CPU is read (psutil) for each server's process and its
children (the engine process), the tokens from each server's /metrics. A host-bound level (a tiny model at
128 streams: the Python work a token is visible) shows what the process split buys where the GIL, not the
model, limits the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmiserve.bench.server import ManagedServer  # noqa: E402


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU of the server `pid` and, together, of its child processes (the engine process)."""
    server = psutil.Process(pid)
    out = {"server": sum(server.cpu_times()[:2])}
    children = 0.0
    for child in server.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            children += sum(child.cpu_times()[:2])
    if children:
        out["children"] = children
    return out


def tokens(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    found = re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def run_level(server: ManagedServer, level: int, args: argparse.Namespace, out: Path) -> dict:
    pid, url = server.pid, server.url
    c0, t0, w0 = cpu_seconds(pid), tokens(url), time.monotonic()
    bench = subprocess.run(
        [sys.executable, "-m", "lmiserve", "bench", "--url", url, "--skip-baselines",
         "--soak-requests", "0", "--concurrency", str(level), "--max-new-tokens", str(args.tokens),
         "--requests-per-client", str(args.requests_per_client), "--client-processes", str(args.client_processes),
         "--output-dir", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.monotonic() - w0
    c1, t1 = cpu_seconds(pid), tokens(url)
    if bench.returncode != 0:
        raise SystemExit(f"bench failed: {bench.stderr[-2000:]}")
    record = json.loads((out / "bench.json").read_text())
    row = next(r for r in record["servers"][0]["levels"] if r["concurrency"] == level)
    n = t1 - t0
    cpu = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    return {
        "tokens_per_s": row["output_tokens_per_s"],
        "ttft_ms_p50": row["ttft_ms"]["p50"],
        "itl_ms_p50": row["itl_ms"]["p50"],
        "failed": row["failed_requests"] + row["token_count_errors"],
        "tokens": n,
        "wall_s": round(wall, 2),
        "us_cpu_per_token": {k: round(1e6 * v / n, 1) for k, v in cpu.items()},
        "us_cpu_per_token_total": round(1e6 * sum(cpu.values()) / n, 1),
    }


def lscpu_model() -> str:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return text.split("Model name:")[-1].split("\n")[0].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--concurrency", default="128")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("-o", "--option", action="append", default=[])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    out = Path(args.json).parent if args.json else Path("/tmp/engine-process-bench")
    out.mkdir(parents=True, exist_ok=True)
    common = [f"max_rolling_batch_size={max(levels)}", *args.option]
    results: dict[str, dict[str, list[dict]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra in (("in_process", []), ("engine_process", ["engine_process=true"])):
            serve_args = ["--model-id", args.model_id, *[a for o in common + extra for a in ("-o", o)]]
            servers[name] = stack.enter_context(ManagedServer(serve_args, out / f"server-{name}.log"))
        for level in levels:
            for name in ("in_process", "engine_process", "engine_process", "in_process") * args.rounds:
                row = run_level(servers[name], level, args, out / f"bench-{name}")
                results.setdefault(str(level), {}).setdefault(name, []).append(row)
                print(level, name, json.dumps(row), flush=True)
    summary = {}
    for level, by in results.items():
        summary[level] = {
            name: {
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
                "us_cpu_per_token_median": statistics.median(r["us_cpu_per_token_total"] for r in rows),
            }
            for name, rows in by.items()
        }
        a, b = summary[level]["in_process"], summary[level]["engine_process"]
        summary[level]["ratio"] = round(b["tokens_per_s_median"] / a["tokens_per_s_median"], 3)
        print(
            f"concurrency {level}: in process {a['tokens_per_s_median']:.0f} tok/s, engine process "
            f"{b['tokens_per_s_median']:.0f} tok/s ({summary[level]['ratio']}x)",
            flush=True,
        )
    document = {
        "what": "tokens/s and CPU a token of one server with its engine in process and one with engine_process=true",
        "cpu": subprocess.run(["lscpu"], capture_output=True, text=True)
        .stdout.split("Model name:")[-1]
        .split("\n")[0]
        .strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "model": args.model_id,
        "options": common,
        "tokens_per_request": args.tokens,
        "summary": summary,
        "runs": results,
        "load_average_end": os.getloadavg(),
    }
    if args.json:
        args.json.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
