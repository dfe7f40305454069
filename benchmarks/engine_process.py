"""The engine core in the server's process or in its own (`engine_process`), at many streams: tokens/s and the
CPU each process spends a streamed token, the two servers measured in turns (ABBA) in one run.

    .venv/bin/python benchmarks/engine_process.py --model-id DIR [--concurrency 128] [--tokens 128]
        [--requests-per-client 2] [--rounds 2] [--client-processes N] [-o KEY=VALUE ...] [--json FILE]

Starts `lmiserve serve` twice on `--model-id` (the same options, `max_rolling_batch_size` = the largest
concurrency; one with `engine_process=true`), then per level and round runs `lmiserve bench --url ...
--skip-baselines` against each in ABBA order. The CPU is read from /proc for each server's process and its
children (the engine process), the tokens from each server's /metrics. A host-bound level (a tiny model at
128 streams: the Python work a token is visible) shows what the process split buys where the GIL, not the
model, limits the server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_seconds(pid: int) -> dict[str, float]:
    """utime + stime of `pid` (server) and of its child processes together (children: the engine process)."""
    out: dict[str, float] = {}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for name, p in [("server", pid)] + [("children", int(c)) for c in children]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return out


def tokens(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def start(model_id: str, options: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port, grpc = free_port(), free_port()
    args = [sys.executable, "-m", "lmiserve", "serve", "--model-id", model_id, "--port", str(port)]
    for option in [*options, f"grpc_port={grpc}"]:
        args += ["-o", option]
    process = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status == 200:
                return process, port
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"server did not start: {log}")


def run_level(port: int, pid: int, level: int, args: argparse.Namespace, out: Path) -> dict:
    c0, t0, w0 = cpu_seconds(pid), tokens(port), time.monotonic()
    bench = subprocess.run(
        [sys.executable, "-m", "lmiserve", "bench", "--url", f"http://127.0.0.1:{port}", "--skip-baselines",
         "--soak-requests", "0", "--concurrency", str(level), "--max-new-tokens", str(args.tokens),
         "--requests-per-client", str(args.requests_per_client), "--client-processes", str(args.client_processes),
         "--output-dir", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.monotonic() - w0
    c1, t1 = cpu_seconds(pid), tokens(port)
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
    servers = {}
    for name, extra in (("in_process", []), ("engine_process", ["engine_process=true"])):
        servers[name] = start(args.model_id, common + extra, out / f"server-{name}.log")
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        for level in levels:
            for name in ("in_process", "engine_process", "engine_process", "in_process") * args.rounds:
                process, port = servers[name]
                row = run_level(port, process.pid, level, args, out / f"bench-{name}")
                results.setdefault(str(level), {}).setdefault(name, []).append(row)
                print(level, name, json.dumps(row), flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)
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
