"""Long-prompt mix: do short chat requests still get their first token quickly while long prompts
are being prefilled? (issue #20, "Engine v2": one token budget a step.)

Against each server in turn (never two at once, so they do not share the CPU):

- **mix** (default): one "long" client sends a ~`--long-tokens`-token prompt (the bench's story text
  repeated, with a unique tag in front so that no prefix cache can serve it) with `max_new_tokens`
  `--long-max-new-tokens` every `--long-every` seconds (never more than one in flight: when the previous
  one is still running, the next is sent as soon as it ends, and the report counts the late ones), and
  `--short-clients` closed-loop clients send short chat-like prompts (`PROMPTS` of the bench of at most
  20 words) with `--short-max-new-tokens` forced tokens, all streamed over LMI `/invocations`
  (`"stream": true`, jsonlines). After `--warmup` seconds of the same load, requests *started* in the
  next `--duration` seconds are measured (the ones still in flight at the end are waited for); tokens/s
  counts the tokens received inside the window.
- **repro** (`--repro`): the issue's reproduction. A short 1-token request alone (`--repro-alone`
  times, after one warm-up request), then one `--repro-long-tokens`-token prompt (`max_new_tokens` 1)
  and, `--repro-delay` s later, the same short 1-token request: the short request's TTFT behind the
  long prompt, and the long prompt's own TTFT.

Servers: `--url NAME=URL` (repeatable) for running servers, or `--option-set NAME=KEY=VALUE[,KEY=VALUE]`
(repeatable) to start `lmiserve serve -o KEY=VALUE ...` with the bundled model on a free port for each
(as `lmiserve bench` does), one after another. Prints a table and writes JSON (`--output`).

    .venv/bin/python benchmarks/long_prompt_mix.py --option-set paged=kv_cache=paged \\
        --option-set slots=kv_cache=slots --mode both --short-clients 4 --long-every 10 --duration 60 \\
        --output benchmarks/results/long-prompt-mix.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from machine import cpu_model  # benchmarks/machine.py: the script's folder is on sys.path

from lmiserve.bench.machine import load_average, machine_info, versions
from lmiserve.bench.prompts import _LONG_CONTEXT, SHORT_PROMPTS
from lmiserve.bench.server import ManagedServer
from lmiserve.bench.stats import percentile

REQUEST_TIMEOUT = 900.0
REPRO_SHORT_PROMPT = "Why is the sky blue?"


# ---------------------------------------------------------------------------------------------
# prompts of an exact token length


class PromptMaker:
    """Prompts of (about) N tokens for the bundled model's tokenizer: a unique tag, then the bench's
    story text repeated, cut at N tokens."""

    def __init__(self, model_id: str | None):
        from transformers import AutoTokenizer

        if model_id is None:
            from lmiserve.models import bundled_model_path

            model_id = str(bundled_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(model_id)
        self._cache: dict[int, list[int]] = {}

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def make(self, tokens: int, tag: str) -> tuple[str, int]:
        head = f"[{tag}] "
        body_ids = self._cache.get(tokens)
        if body_ids is None:
            text = _LONG_CONTEXT * (tokens // 100 + 4)
            body_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._cache[tokens] = body_ids
        want = tokens - self.count(head)
        prompt = head + self.tokenizer.decode(body_ids[:want])
        # re-tokenising may merge/split at the seams: trim or pad by a token or two
        for _ in range(8):
            n = self.count(prompt)
            if n == tokens:
                break
            want += tokens - n
            prompt = head + self.tokenizer.decode(body_ids[:want])
        return prompt, self.count(prompt)


# ---------------------------------------------------------------------------------------------
# one streamed request


@dataclass
class Rec:
    kind: str  # "short" | "long"
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None
    prompt_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


async def stream_request(client: httpx.AsyncClient, url: str, prompt: str, max_new_tokens: int, rec: Rec) -> Rec:
    payload = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True},
        "stream": True,
    }
    try:
        async with client.stream("POST", f"{url}/invocations", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {response.status_code}: {body[:300]}"
                return rec
            async for line in response.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                if not line:
                    continue
                if line.startswith("data:"):
                    line = line[5:].strip()
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    rec.error = f"not a JSON line: {line[:200]}"
                    return rec
                if isinstance(obj, dict) and "error" in obj:
                    rec.error = f"error in stream: {str(obj['error'])[:300]}"
                    return rec
                if isinstance(obj, dict) and "token" in obj:
                    rec.token_times.append(now)
        if len(rec.token_times) != max_new_tokens:
            rec.error = f"{len(rec.token_times)} tokens, expected {max_new_tokens}"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end = time.perf_counter()
    return rec


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def dist_ms(values: list[float]) -> dict[str, Any]:
    return {
        "p50": _ms(percentile(values, 50)),
        "p90": _ms(percentile(values, 90)),
        "p99": _ms(percentile(values, 99)),
        "max": _ms(max(values)) if values else None,
        "count": len(values),
    }


# ---------------------------------------------------------------------------------------------
# the mix


async def run_mix(url: str, name: str, args: argparse.Namespace, maker: PromptMaker) -> dict[str, Any]:
    records: list[Rec] = []
    limits = httpx.Limits(max_connections=args.short_clients + 8, max_keepalive_connections=args.short_clients + 8)
    t_start = time.perf_counter()
    t_warm = t_start + args.warmup
    t_end = t_warm + args.duration
    long_late = 0
    long_tokens_seen: list[int] = []

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits, trust_env=False) as client:

        async def short_client(c: int) -> None:
            i = 0
            # stagger the clients' first requests a little
            await asyncio.sleep(0.1 * c)
            while time.perf_counter() < t_end:
                prompt = SHORT_PROMPTS[(c + i * args.short_clients) % len(SHORT_PROMPTS)]
                rec = Rec("short", time.perf_counter())
                records.append(rec)
                await stream_request(client, url, prompt, args.short_max_new_tokens, rec)
                i += 1

        async def long_client() -> None:
            nonlocal long_late
            k = 0
            next_send = t_start + args.long_offset
            while True:
                now = time.perf_counter()
                if next_send > now:
                    await asyncio.sleep(next_send - now)
                if time.perf_counter() >= t_end:
                    return
                prompt, n = maker.make(args.long_tokens, f"{name} long request {k} {time.time_ns()}")
                long_tokens_seen.append(n)
                rec = Rec("long", time.perf_counter(), prompt_tokens=n)
                records.append(rec)
                await stream_request(client, url, prompt, args.long_max_new_tokens, rec)
                scheduled = next_send + args.long_every
                if rec.end is not None and rec.end > scheduled:
                    long_late += 1
                next_send = max(scheduled, rec.end or scheduled)
                k += 1

        await asyncio.gather(long_client(), *(short_client(c) for c in range(args.short_clients)))
    t_done = time.perf_counter()

    measured = [r for r in records if t_warm <= r.start < t_end]
    shorts = [r for r in measured if r.kind == "short"]
    longs = [r for r in measured if r.kind == "long"]
    ok_short = [r for r in shorts if r.error is None]
    ok_long = [r for r in longs if r.error is None]
    in_window = sum(1 for r in records for t in r.token_times if t_warm <= t < t_end)
    short_in_window = sum(1 for r in records if r.kind == "short" for t in r.token_times if t_warm <= t < t_end)
    errors = [f"{r.kind}: {r.error}" for r in records if r.error is not None]
    return {
        "short": {
            "ttft_ms": dist_ms([r.ttft for r in ok_short if r.ttft is not None]),
            "itl_ms": dist_ms([x for r in ok_short for x in r.itls]),
            "completed": len(ok_short),
            "failed": len(shorts) - len(ok_short),
        },
        "long": {
            "ttft_ms": dist_ms([r.ttft for r in ok_long if r.ttft is not None]),
            "completed": len(ok_long),
            "failed": len(longs) - len(ok_long),
            "sent_late": long_late,
            "prompt_tokens": sorted(set(long_tokens_seen)),
        },
        "tokens_per_s": round(in_window / args.duration, 2),
        "short_tokens_per_s": round(short_in_window / args.duration, 2),
        "requests_completed": len(ok_short) + len(ok_long),
        "requests_failed": len(errors),
        "errors": errors[:20],
        "drain_s": round(t_done - t_end, 1),
    }


# ---------------------------------------------------------------------------------------------
# the reproduction


async def run_repro(url: str, name: str, args: argparse.Namespace, maker: PromptMaker) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, trust_env=False) as client:
        await stream_request(client, url, REPRO_SHORT_PROMPT, 1, Rec("short", time.perf_counter()))  # warm-up
        alone: list[Rec] = []
        for _ in range(args.repro_alone):
            rec = await stream_request(client, url, REPRO_SHORT_PROMPT, 1, Rec("short", time.perf_counter()))
            alone.append(rec)
            await asyncio.sleep(0.2)
        prompt, n = maker.make(args.repro_long_tokens, f"{name} repro {time.time_ns()}")
        long_rec = Rec("long", time.perf_counter(), prompt_tokens=n)
        long_task = asyncio.create_task(stream_request(client, url, prompt, 1, long_rec))
        await asyncio.sleep(args.repro_delay)
        short_rec = await stream_request(client, url, REPRO_SHORT_PROMPT, 1, Rec("short", time.perf_counter()))
        await long_task
    alone_ttfts = [r.ttft for r in alone if r.error is None and r.ttft is not None]
    errors = [r.error for r in (*alone, long_rec, short_rec) if r.error]
    return {
        "long_prompt_tokens": n,
        "short_prompt_tokens": maker.count(REPRO_SHORT_PROMPT),
        "short_ttft_behind_long_ms": _ms(short_rec.ttft),
        "short_alone_ttft_ms": {"p50": _ms(percentile(alone_ttfts, 50)), "all": [_ms(t) for t in alone_ttfts]},
        "long_ttft_ms": _ms(long_rec.ttft),
        "short_finished_before_long": (short_rec.end or 0) < (long_rec.end or 0),
        "errors": errors,
    }


# ---------------------------------------------------------------------------------------------
# servers and the command


def parse_option_set(text: str) -> tuple[str, list[tuple[str, str]]]:
    name, _, rest = text.partition("=")
    if not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[,KEY=VALUE], got {text!r}")
    options = []
    for part in rest.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE in {text!r}, got {part!r}")
        options.append((key.strip(), value.strip()))
    return name, options


def parse_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url.rstrip("/")


def print_table(results: dict[str, Any]) -> None:
    servers = results["servers"]
    if any("repro" in s for s in servers.values()):
        print(
            "\nrepro: {}-token prompt (max_new_tokens 1), short 1-token request {:.1f} s later".format(
                next(iter(servers.values())).get("repro", {}).get("long_prompt_tokens"), results["args"]["repro_delay"]
            )
        )
        print(f"{'server':<12} {'short TTFT behind long ms':>26} {'short alone ms (p50)':>21} {'long TTFT ms':>13}")
        for name, s in servers.items():
            r = s.get("repro")
            if r:
                print(
                    f"{name:<12} {r['short_ttft_behind_long_ms']!s:>26} {r['short_alone_ttft_ms']['p50']!s:>21} "
                    f"{r['long_ttft_ms']!s:>13}" + (f"  errors: {r['errors']}" if r["errors"] else "")
                )
    if any("mix" in s for s in servers.values()):
        a = results["args"]
        print(
            f"\nmix: {a['short_clients']} short clients ({a['short_max_new_tokens']} tokens), "
            f"a {a['long_tokens']}-token prompt every {a['long_every']} s ({a['long_max_new_tokens']} tokens), "
            f"{a['duration']} s after {a['warmup']} s warm-up"
        )
        print(
            f"{'server':<12} {'short TTFT p50/p90/p99 ms':>28} {'short ITL p50/p99 ms':>21} "
            f"{'long TTFT p50/p90/p99 ms':>28} {'tok/s':>7} {'short/long done':>16} {'failed':>7} {'load':>16}"
        )
        for name, s in servers.items():
            m = s.get("mix")
            if not m:
                continue
            st, si, lt = m["short"]["ttft_ms"], m["short"]["itl_ms"], m["long"]["ttft_ms"]
            print(
                f"{name:<12} {st['p50']!s:>8}/{st['p90']!s}/{st['p99']!s:<9} {si['p50']!s:>9}/{si['p99']!s:<8} "
                f"{lt['p50']!s:>9}/{lt['p90']!s}/{lt['p99']!s:<8} {m['tokens_per_s']:>7} "
                f"{m['short']['completed']:>8}/{m['long']['completed']:<7} {m['requests_failed']:>7} "
                f"{s['load_average_after']!s:>16}"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", type=parse_url, default=[], metavar="NAME=URL")
    p.add_argument("--option-set", action="append", type=parse_option_set, default=[], metavar="NAME=KEY=VALUE[,K=V]")
    p.add_argument("--model-id", help="model of the started servers and of the tokenizer (default: the bundled one)")
    p.add_argument("--mode", choices=("mix", "repro", "both"), default="mix")
    p.add_argument("--repro", action="store_true", help="the issue's reproduction only (same as --mode repro)")
    p.add_argument("--short-clients", type=int, default=4)
    p.add_argument("--short-max-new-tokens", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-max-new-tokens", type=int, default=8)
    p.add_argument("--long-every", type=float, default=10.0)
    p.add_argument("--long-offset", type=float, default=1.0, help="seconds before the first long request")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--repro-long-tokens", type=int, default=3001)
    p.add_argument("--repro-delay", type=float, default=1.0)
    p.add_argument("--repro-alone", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, help="where the started servers' logs go (default: a temp dir)")
    p.add_argument("--output", type=Path, help="JSON file to write")
    args = p.parse_args()
    if args.repro:
        args.mode = "repro"
    if not args.url and not args.option_set:
        p.error("give --url NAME=URL or --option-set NAME=KEY=VALUE at least once")

    maker = PromptMaker(args.model_id)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="long-prompt-mix-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "benchmark": "long_prompt_mix",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu_model": cpu_model(),
        "machine": machine_info(),
        "versions": versions(),
        "load_average_start": load_average(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": {},
    }

    targets: list[tuple[str, str | None, list[tuple[str, str]]]] = [(n, u, []) for n, u in args.url]
    targets += [(n, None, opts) for n, opts in args.option_set]
    for name, url, opts in targets:
        entry: dict[str, Any] = {"url": url, "options": dict(opts), "load_average_before": load_average()}
        server = None
        try:
            if url is None:
                serve_args = ["--model-id", args.model_id] if args.model_id else []
                for key, value in opts:
                    serve_args += ["-o", f"{key}={value}"]
                server = ManagedServer(serve_args, log_dir / f"server-{name}.log", args.startup_timeout)
                t0 = time.perf_counter()
                url = server.start()
                entry["startup_s"] = round(time.perf_counter() - t0, 1)
                entry["serve_command"] = " ".join(server.command)
                entry["log"] = str(server.log_path)
                print(f"[{name}] started {url} in {entry['startup_s']} s (pid {server.pid})", flush=True)
            if args.mode in ("repro", "both"):
                print(f"[{name}] repro ... load {load_average()}", flush=True)
                entry["repro"] = asyncio.run(run_repro(url, name, args, maker))
                print(f"[{name}] repro: {json.dumps(entry['repro'])}", flush=True)
            if args.mode in ("mix", "both"):
                print(
                    f"[{name}] mix ({args.warmup + args.duration:.0f} s + drain) ... load {load_average()}", flush=True
                )
                entry["mix"] = asyncio.run(run_mix(url, name, args, maker))
                print(f"[{name}] mix: {json.dumps(entry['mix'])}", flush=True)
        finally:
            entry["load_average_after"] = load_average()
            if server is not None:
                server.stop()
        results["servers"][name] = entry
    results["load_average_end"] = load_average()

    print(
        f"\nCPU: {results['cpu_model']} ({os.cpu_count()} logical CPUs); load average start "
        f"{results['load_average_start']}, end {results['load_average_end']}"
    )
    print_table(results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
