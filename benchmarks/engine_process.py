"""The engine core in the server's process or in its own (`engine_process`), at many streams: tokens/s and the
CPU each process spends a streamed token, the two servers measured in turns (ABBA) in one run.

    .venv/bin/python benchmarks/engine_process.py --model-id DIR [--concurrency 128] [--tokens 128]
        [--requests-per-client 2] [--rounds 2] [--client-processes N] [-o KEY=VALUE ...] [--json FILE] [--probe]

Starts `lmiserve serve` twice on `--model-id` (the same options, `max_rolling_batch_size` = the largest
concurrency; one with `engine_process=false`, one with `engine_process=true`), then per level and round runs
`lmiserve bench --url ... --skip-baselines` against each in ABBA order. The CPU is read (psutil) for each
server's process and its children (the engine process), the tokens and the engine's own time to first token
(`engine_ttft_ms_mean`, from its arrival in the engine) from each server's /metrics; with `--probe` a light
client's time to first token beside the bench's (`probe_ttft_ms_p50`: the bench's one-process client reading
128 streams adds its own lag to its `ttft_ms_p50` on a small machine). A host-bound level (a tiny model at 128
streams: the Python work a token is visible) shows what the process split buys where the GIL, not the model,
limits the server.

`--baselines`: once both servers have stopped, static `generate()` of the same model (loaded as the servers
load it: the `-o` options) at each level's batch size, in this process (`lmiserve.bench.baselines`, what
`lmiserve bench` runs): each mode's tokens/s over it (`over_generate`), issue 39's ratio, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402 - benchmarks/machine.py: the script's folder is on sys.path

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


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def counters(url: str) -> dict[str, float]:
    """The server's generated tokens, and its engine's time-to-first-token histogram's sum and count."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    names = (
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    )
    return {name: metric(text, name) for name in names}


def probe(port: int, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """One light client beside the bench's: a streamed 8-token LMI request at a time (a blocking socket, no
    event loop of its own to fall behind), its time to the first token recorded with when it was sent."""
    body = json.dumps({"inputs": "The capital of France is", "stream": True,
                       "parameters": {"max_new_tokens": 8, "ignore_eos_token": True}})  # fmt: skip
    while not stop.is_set():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        sent = time.monotonic()
        connection.request("POST", "/invocations", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        first = None
        for line in response:
            if first is None and b'"token"' in line:
                first = time.monotonic() - sent
        connection.close()
        if first is not None:
            samples.append((sent, first))
        stop.wait(0.05)


def run_level(server: ManagedServer, level: int, args: argparse.Namespace, out: Path) -> dict:
    pid, url = server.pid, server.url
    stop, samples = threading.Event(), []
    prober = threading.Thread(target=probe, args=(server.port, stop, samples), daemon=True)
    c0, m0, w0 = cpu_seconds(pid), counters(url), time.monotonic()
    if args.probe:
        prober.start()
    bench = subprocess.run(
        [sys.executable, "-m", "lmiserve", "bench", "--url", url, "--skip-baselines",
         "--soak-requests", "0", "--concurrency", str(level), "--max-new-tokens", str(args.tokens),
         "--requests-per-client", str(args.requests_per_client), "--client-processes", str(args.client_processes),
         "--output-dir", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.monotonic() - w0
    stop.set()
    if args.probe:
        prober.join()
    c1, m1 = cpu_seconds(pid), counters(url)
    if bench.returncode != 0:
        raise SystemExit(f"bench failed: {bench.stderr[-2000:]}")
    record = json.loads((out / "bench.json").read_text())
    row = next(r for r in record["servers"][0]["levels"] if r["concurrency"] == level)
    n = m1["vllm:generation_tokens_total"] - m0["vllm:generation_tokens_total"]
    firsts = m1["vllm:time_to_first_token_seconds_count"] - m0["vllm:time_to_first_token_seconds_count"]
    ttft_sum = m1["vllm:time_to_first_token_seconds_sum"] - m0["vllm:time_to_first_token_seconds_sum"]
    cpu = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    # the probe's samples of the middle 60 % of the run: the bench's clients all streaming (not its start-up)
    steady = [1e3 * ttft for sent, ttft in samples if w0 + 0.2 * wall <= sent <= w0 + 0.8 * wall]
    return {
        "tokens_per_s": row["output_tokens_per_s"],
        "ttft_ms_p50": row["ttft_ms"]["p50"],
        "engine_ttft_ms_mean": round(1e3 * ttft_sum / firsts, 1) if firsts else None,
        **({"probe_ttft_ms_p50": round(statistics.median(steady), 1), "probe_samples": len(steady)} if steady else {}),
        "itl_ms_p50": row["itl_ms"]["p50"],
        "failed": row["failed_requests"] + row["token_count_errors"],
        "tokens": n,
        "wall_s": round(wall, 2),
        "us_cpu_per_token": {k: round(1e6 * v / n, 1) for k, v in cpu.items()},
        "us_cpu_per_token_total": round(1e6 * sum(cpu.values()) / n, 1),
    }


TTFT_KEYS = ("ttft_ms_p50", "engine_ttft_ms_mean", "probe_ttft_ms_p50")


def median_of(rows: list[dict], key: str) -> float | None:
    """The median of `key` over the runs that have it (the probe's only with --probe), None when none has."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 1) if values else None


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
    parser.add_argument(
        "--probe", action="store_true",
        help="a light client beside the bench's: its time to first token under the load (probe_ttft_ms_p50)",
    )  # fmt: skip
    parser.add_argument(
        "--baselines", action="store_true",
        help="after the servers: static generate() at each level's batch, each mode's tokens/s over it",
    )  # fmt: skip
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    out = Path(args.json).parent if args.json else Path("/tmp/engine-process-bench")
    out.mkdir(parents=True, exist_ok=True)
    common = [f"max_rolling_batch_size={max(levels)}", *args.option]
    results: dict[str, dict[str, list[dict]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra in (("in_process", ["engine_process=false"]), ("engine_process", ["engine_process=true"])):
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
                **{f"{key}_median": median_of(rows, key) for key in TTFT_KEYS},
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
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "model": args.model_id,
        "options": common,
        "tokens_per_request": args.tokens,
        "summary": summary,
        "runs": results,
        "load_average_end": os.getloadavg(),
    }
    if args.json:  # written now: the baselines below may not finish inside a caller's time limit
        args.json.write_text(json.dumps(document, indent=1))
    if args.baselines:
        add_baselines(document, args, levels)
        if args.json:
            args.json.write_text(json.dumps(document, indent=1))


def add_baselines(document: dict, args: argparse.Namespace, levels: list[int]) -> None:
    """Static generate() at each level's batch (the servers have stopped: the GPU is free), and each mode's
    tokens/s over it, into `document`'s summary."""
    from lmiserve.bench.baselines import run_baselines  # torch: only here
    from lmiserve.bench.report import baseline_rate
    from lmiserve.config.sources import parse_override

    overrides = {"model_id": args.model_id, **dict(parse_override(o) for o in args.option)}
    baselines = run_baselines(overrides, levels, args.tokens, lambda line: print(line, flush=True))
    document["baselines"] = baselines
    for level in levels:
        generate = baseline_rate(baselines, "generate", level)
        entry = document["summary"][str(level)]
        entry["generate_tokens_per_s"] = generate
        for name in ("in_process", "engine_process"):
            mode = entry[name]
            mode["over_generate"] = round(mode["tokens_per_s_median"] / generate, 3) if generate else None
        print(
            f"concurrency {level}: generate() {generate} tok/s; over it: in process "
            f"{entry['in_process']['over_generate']}, engine process {entry['engine_process']['over_generate']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
