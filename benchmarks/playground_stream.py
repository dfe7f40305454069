"""The playground page while a long chat streams into it: does the page still answer? Each mode's page (the
playground's JavaScript at a git revision, or the working tree's) runs in Debian's headless Chromium against
one server of the tests' tiny model that never ends a reply; every half second the page is asked for the
reply's text (a Playwright locator query: it waits for the page's main thread), and the time it took is kept.

    .venv/bin/python benchmarks/playground_stream.py [--before REV] [--seconds 20] [--hogs 0,2] [--json FILE]

A page that does a layout a token falls behind a fast stream: its stream loop then never yields to the
page's other tasks (the chunks are already buffered, so each read resolves at once), the queries time out
(30 s) and so does a click of Stop. `--hogs N` runs N busy Python loops beside it (a loaded machine: the
server streams slower). The revision's JavaScript is served to the page by Playwright's routing
(`page.route`), so the same server serves both.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from machine import cpu_model  # noqa: E402 - benchmarks/machine.py: the script's folder is on sys.path

from helpers.browser import chromium_path  # noqa: E402
from helpers.server import run_server  # noqa: E402
from helpers.tiny_model import (  # noqa: E402
    ENDLESS_CONTEXT,
    build_tiny_model_dir,
    build_unreachable_eos_model_dir,
    with_context,
)

SCRIPT = "/playground/playground.js"


def run_mode(base: str, script: str | None, seconds: float, hogs: int) -> dict:
    """One page, one long chat streamed for `seconds`: the queries' times, the reply's length, Stop."""
    from playwright.sync_api import Error, sync_playwright

    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(hogs)]
    queries: list[float] = []
    result: dict = {"hogs": hogs}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), headless=True)
            page = browser.new_page()
            if script is not None:
                page.route(f"**{SCRIPT}", lambda route: route.fulfill(body=script, content_type="text/javascript"))
            page.goto(base + "/playground")
            page.fill("#max_tokens", "1000000")
            page.fill("#seed", "7")
            page.fill("#prompt", "Tell me a very long story.")
            page.click("#send")
            page.locator(".msg.assistant.streaming").wait_for()
            start = time.monotonic()
            try:
                while time.monotonic() - start < seconds:
                    asked = time.monotonic()
                    result["reply_chars"] = len(page.locator(".msg.assistant").last.inner_text())
                    queries.append(1e3 * (time.monotonic() - asked))
                    time.sleep(0.5)
                page.click("#stop")
                page.locator(".msg.assistant .note", has_text="(stopped)").wait_for()
                result["usage"] = page.locator("#usage").inner_text()
            except Error as exc:  # a query or Stop timed out: the page did not answer
                result["error"] = str(exc).splitlines()[0]
                result["failed_after_s"] = round(time.monotonic() - start, 1)
            browser.close()
    finally:
        for process in busy:
            process.kill()
    if queries:
        result["query_ms"] = {
            "count": len(queries),
            "p50": round(statistics.median(queries), 1),
            "max": round(max(queries), 1),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a git revision whose playground.js is measured beside the working tree's")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each chat streams (default 20)")
    parser.add_argument("--hogs", default="0,2", help="busy loops beside the page, one run each (default 0,2)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if chromium_path() is None:
        raise SystemExit("Debian's chromium is not installed (make install-test installs it)")
    modes: dict[str, str | None] = {"working tree": None}
    if args.before:
        old = subprocess.run(
            ["git", "show", f"{args.before}:lmiserve/server/playground/playground.js"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        modes = {args.before: old.stdout, **modes}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model_dir(Path(tmp) / "tiny")
        no_eos = build_unreachable_eos_model_dir(tiny, Path(tmp) / "no-eos")
        endless = with_context(no_eos, Path(tmp) / "endless", ENDLESS_CONTEXT)
        options = ["-o", "max_rolling_batch_size=2", "-o", f"max_new_tokens_limit={ENDLESS_CONTEXT}"]
        with run_server(["--model-id", str(endless), "--grpc-port", "0", *options]) as base:
            for hogs in [int(h) for h in args.hogs.split(",")]:
                for name, script in modes.items():
                    row = {"mode": name, **run_mode(base, script, args.seconds, hogs)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.json:
        record = {"cpu": cpu_model(), "machine": platform.machine(), "seconds": args.seconds, "runs": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
