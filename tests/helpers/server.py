"""Run `python -m lmiserve serve ...` as a subprocess for end-to-end tests:

    with run_server(["--model-id", str(tiny_model_dir), "-o", "max_rolling_batch_size=4"]) as url:
        httpx.post(f"{url}/invocations", json={...})

The server is stopped when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STARTUP_TIMEOUT = 120.0
CANNOT_LISTEN = 3  # lmiserve serve's exit status for a port in use (lifecycle.ExitCode.CANNOT_LISTEN)
PORT_TRIES = 3


class PortTaken(RuntimeError):
    """The server exited with CANNOT_LISTEN: a port it was given was taken before it could bind it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def on_a_free_port(start: Callable[[int], T], host: str = "127.0.0.1") -> tuple[T, int]:
    """`start(port)` on a port `free_port` picks, and on a new one if the server found it taken.

    A port that was free a moment ago can be taken (by any process's outgoing connection: they share
    the ephemeral range) before the server binds it; the server then exits CANNOT_LISTEN at once.
    """
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port(host)
        try:
            return start(port), port
        except PortTaken:
            if attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def run_server(
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    timeout: float = DEFAULT_STARTUP_TIMEOUT,
    command: Sequence[str] | None = None,
    stderr_path: Path | None = None,
) -> Iterator[str]:
    """Start the server on a free port, wait until GET /ping answers 200, yield its base URL.

    `--host`/`--port` are added unless `args` has them. `env` is layered over os.environ (the repo
    root is put on PYTHONPATH). The process is stopped at the end (SIGTERM, then SIGKILL after
    10 s); its stderr is printed if it fails to start or the body of the `with` raises.
    `command` replaces `python -m lmiserve serve` (to test this helper with a fake server).
    With `stderr_path`, the server's stderr (its log) goes to that file, which tests may read while it
    runs (`read_log`).
    """
    args = list(args)
    if "--host" in args:
        host = args[args.index("--host") + 1]
    else:
        args += ["--host", host]
    if "--port" in args:
        port = int(args[args.index("--port") + 1])
        with _serve(args, env, f"http://{host}:{port}", timeout, command, stderr_path) as url:
            yield url
        return
    with contextlib.ExitStack() as stack:  # a port picked here is picked again if it was taken before the bind

        def start(port: int) -> str:
            served = _serve([*args, "--port", str(port)], env, f"http://{host}:{port}", timeout, command, stderr_path)
            return stack.enter_context(served)

        url, _ = on_a_free_port(start, host)
        yield url


@contextlib.contextmanager
def _serve(
    args: Sequence[str],
    env: Mapping[str, str] | None,
    url: str,
    timeout: float,
    command: Sequence[str] | None,
    stderr_path: Path | None,
) -> Iterator[str]:
    proc_env = dict(os.environ)
    proc_env.update(env or {})
    proc_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), proc_env.get("PYTHONPATH", "")) if p)
    proc_env.setdefault("PYTHONUNBUFFERED", "1")
    base = list(command) if command is not None else [sys.executable, "-m", "lmiserve", "serve"]
    cmd = [*base, *args]

    # Files, not pipes: a chatty server can never block on a full pipe buffer.
    errors = open(stderr_path, "w+b") if stderr_path is not None else tempfile.TemporaryFile()  # noqa: SIM115
    with tempfile.TemporaryFile() as out, errors as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=proc_env, stdout=out, stderr=err)
        try:
            _wait_ready(proc, url, timeout)
            yield url
        except BaseException:
            _stop(proc)
            _dump(cmd, proc, out, err)
            raise
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            error = PortTaken if proc.returncode == CANNOT_LISTEN else RuntimeError
            raise error(f"server exited with code {proc.returncode} before answering /ping")
        try:
            with opener.open(f"{url}/ping", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} did not answer GET /ping with 200 within {timeout:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _dump(cmd: Sequence[str], proc: subprocess.Popen[bytes], out: IO[bytes], err: IO[bytes]) -> None:
    def tail(handle: IO[bytes], limit: int = 20_000) -> str:
        handle.seek(0)
        return handle.read()[-limit:].decode("utf-8", errors="replace")

    print(
        f"\n--- server {' '.join(cmd)} (exit code {proc.returncode}) ---\n"
        f"--- stdout ---\n{tail(out)}\n--- stderr ---\n{tail(err)}\n--- end of server output ---",
        file=sys.stderr,
    )


def read_log(path: Path) -> list[str]:
    """The complete lines a server started with `stderr_path=path` has logged so far."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text.split("\n")[:-1]  # the last piece is "" or a line still being written
