"""The server `lmiserve bench` starts itself (a `lmiserve serve` subprocess on a free port) and the
sampler of its resident memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from lmiserve.bench.clients import BenchError

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def no_grpc(serve_args: Sequence[str]) -> list[str]:
    """`--grpc-port 0` (gRPC off) unless the arguments or the environment name a gRPC port: the bench
    speaks HTTP, and a second server (`--ab-option`) would find the first on the default port 8081."""
    named = any(a == "--grpc-port" or a.startswith(("--grpc-port=", "grpc_port=")) for a in serve_args)
    return [] if named or "OPTION_GRPC_PORT" in os.environ else ["--grpc-port", "0"]


class ManagedServer:
    """`python -m lmiserve serve <args> --host 127.0.0.1 --port <free>`, output to `log_path`."""

    def __init__(self, serve_args: Sequence[str], log_path: Path, startup_timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "lmiserve",
            "serve",
            *serve_args,
            *no_grpc(serve_args),
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> str:
        """Start the process and wait until GET /ping answers 200; BenchError if it does not."""
        self._log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchError(
                        f"the server exited with code {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/ping").status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise BenchError(
            f"the server did not answer GET /ping with 200 within {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode("utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RssSampler:
    """Samples the resident set size of process `pid` every `interval` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.5):
        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    def read(self) -> int | None:
        """Take one sample now (bytes); None once the process is gone."""
        try:
            rss = int(self.process.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        self.samples.append((time.monotonic() - self._t0, rss))
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.read() is None:
                return

    def start(self) -> RssSampler:
        self.read()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.read()

    def summary(self) -> dict[str, Any]:
        """Start/end/max RSS in MiB over the samples so far, and a timeline of at most ~200
        [seconds since start, MiB] points."""
        values = [rss for _, rss in self.samples]

        def mib(size: int) -> float:
            return round(size / 2**20, 1)

        return {
            "samples": len(values),
            "interval_s": self.interval,
            "rss_start_mib": mib(values[0]) if values else None,
            "rss_end_mib": mib(values[-1]) if values else None,
            "rss_max_mib": mib(max(values)) if values else None,
            "timeline": [[round(t, 1), mib(rss)] for t, rss in self.samples[:: max(1, -(-len(self.samples) // 200))]],
        }
