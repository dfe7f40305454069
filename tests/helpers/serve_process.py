"""A `python -m lmiserve serve` process that a test signals and whose exit status and stderr it reads.

    with ServeProcess(["--model-id", str(tiny_model_dir)]) as server:
        server.wait_healthy()
        server.send(signal.SIGTERM)
        assert server.wait_exit() == 0
        assert "stopping: received SIGTERM" in server.stderr()

Unlike `helpers.server.run_server` (which stops the server for the test), the test decides how the
process ends. Waits are on conditions; the only time limits are hang guards (HANG_TIMEOUT, long) that
fail loudly with the server's output. The process is killed at the end of the block if still running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

from helpers.server import REPO_ROOT, free_port
from helpers.waiting import wait_until

HANG_TIMEOUT = 120.0  # seconds; far beyond a start or a stop of the tiny model, even on a loaded machine


class ServeProcess:
    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        port: int | None = None,
        command: Sequence[str] | None = None,
        address: bool = True,
    ) -> None:
        """`command` replaces `python -m lmiserve serve` (e.g. the container's entrypoint); with
        `address=False` no `--host`/`--port` is added (the process must listen on 127.0.0.1:`port`
        by other means, e.g. its environment)."""
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        self.args = [*args, "--host", self.host, "--port", str(self.port)] if address else list(args)
        proc_env = dict(os.environ)
        proc_env.update(env or {})
        proc_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), proc_env.get("PYTHONPATH", "")) if p)
        proc_env["PYTHONUNBUFFERED"] = "1"
        # Files, not pipes: a chatty server never blocks on a full pipe. Closed in __exit__.
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "lmiserve", "serve"]), *self.args],
            cwd=REPO_ROOT,
            env=proc_env,
            stdout=self._out,
            stderr=self._err,
        )

    # ---- what the process says -------------------------------------------------------------------------
    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode("utf-8", errors="replace")

    def stderr_lines(self) -> list[str]:
        return self.stderr().splitlines()

    def describe(self) -> str:
        self._out.seek(0)
        out = self._out.read().decode("utf-8", errors="replace")
        return f"exit code {self.proc.poll()}\n--- stdout ---\n{out[-5000:]}\n--- stderr ---\n{self.stderr()[-20000:]}"

    # ---- waiting -------------------------------------------------------------------------------------
    def ping_status(self) -> int | None:
        """The status of GET /ping, None when nothing answers."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.url}/ping", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited before /ping answered 200:\n{self.describe()}")
            return self.ping_status() == 200

        wait_until(healthy, "GET /ping answers 200", timeout=HANG_TIMEOUT, interval=0.1)

    def wait_stderr(self, text: str) -> None:
        """Until `text` appears on stderr (the process may have exited meanwhile)."""
        wait_until(lambda: text in self.stderr(), f"the server logs {text!r}", timeout=HANG_TIMEOUT, interval=0.05)

    def wait_exit(self) -> int:
        """The exit status; fails loudly (and kills the process) if it is still running after HANG_TIMEOUT."""
        try:
            return self.proc.wait(timeout=HANG_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit within {HANG_TIMEOUT} s:\n{self.describe()}") from None

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    # ---- context -----------------------------------------------------------------------------------
    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if exc is not None:
            print(f"\n--- server {' '.join(self.args)} ---\n{self.describe()}", file=sys.stderr)
        self._err.close()
        self._out.close()
