"""Exit codes and signals of `python -m lmiserve serve`, on real processes with real signals.

- SIGTERM or SIGINT: a clean stop, exit 0 (not "killed by SIGTERM", which orchestrators read as a crash);
- a second signal while stopping (held here by a stream that never ends): exit at once, 128 + signal;
- a startup model that fails to load: exit 1 with one line on stderr naming the model and the cause;
- a port in use: exit 3 with one line, before any model loads.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.serve_process import HANG_TIMEOUT, ServeProcess
from helpers.server import free_port
from helpers.tiny_model import ENDLESS_CONTEXT

pytestmark = pytest.mark.e2e  # the slowest tier: signals to real processes and their exit codes

ENDLESS_STREAM = {
    "inputs": "Deep learning is",
    "stream": True,
    "parameters": {"max_new_tokens": ENDLESS_CONTEXT - 64, "ignore_eos_token": True},
}


def failure_lines(server: ServeProcess) -> list[str]:
    """The lines lmiserve itself writes to stderr when it exits for a reason (not log records)."""
    return [line for line in server.stderr_lines() if line.startswith("lmiserve: ")]


def assert_no_traceback(server: ServeProcess) -> None:
    assert "Traceback" not in server.stderr(), server.describe()


# --- a clean stop ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_exits_0_after_a_clean_shutdown(tiny_model_dir, sig):
    with ServeProcess(["--model-id", str(tiny_model_dir)]) as server:
        server.wait_healthy()
        server.send(sig)
        assert server.wait_exit() == 0, server.describe()
        err = server.stderr()
        assert f"stopping: received {sig.name}" in err
        assert "Application shutdown complete" in err  # the lifespan ran: the engine was stopped
        assert failure_lines(server) == []
        assert_no_traceback(server)


def test_a_stop_signal_while_the_model_loads_exits_0(smollm_dir):
    """SIGTERM as soon as the port is bound: SmolLM2 takes seconds to load, the tiny model a moment;
    either way (the load still running on its thread, or done) the exit is clean."""
    with ServeProcess(["--model-id", str(smollm_dir)]) as server:
        server.wait_stderr("listening on http://")
        server.send(signal.SIGTERM)
        assert server.wait_exit() == 0, server.describe()
        assert failure_lines(server) == []
        assert "Fatal Python error" not in server.stderr()
        assert_no_traceback(server)


# --- a second signal -------------------------------------------------------------------------------------


def _lines(count: int, it: Iterator[str]) -> list[str]:
    lines = []
    for line in it:
        if line:
            lines.append(line)
        if len(lines) == count:
            return lines
    raise AssertionError(f"the stream ended after {len(lines)} lines")


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT)],
    ids=lambda s: s.name,
)
def test_a_second_signal_exits_at_once_while_a_stream_holds_up_the_stop(endless_model_dir, first, second):
    args = ["--model-id", str(endless_model_dir), "-o", f"max_new_tokens_limit={ENDLESS_CONTEXT}"]
    with ServeProcess(args) as server, httpx.Client(base_url=server.url, timeout=HANG_TIMEOUT, trust_env=False) as c:
        server.wait_healthy()
        with c.stream("POST", "/invocations", json=ENDLESS_STREAM) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            _lines(3, lines)

            server.send(first)
            server.wait_stderr(f"stopping: received {first.name}")
            # The stop has begun and waits for the open stream, which goes on: the process cannot exit.
            assert all(json.loads(line)["token"] for line in _lines(3, lines))
            assert server.proc.poll() is None

            server.send(second)
            assert server.wait_exit() == 128 + second, server.describe()
            with pytest.raises(httpx.HTTPError):  # the stream is cut, not ended
                for _ in lines:
                    pass
        assert failure_lines(server) == [f"lmiserve: {second.name} while stopping: exiting now"]
        assert_no_traceback(server)


# --- a failed model load ---------------------------------------------------------------------------------


def _corrupt(tiny: Path, out: Path) -> Path:
    shutil.copytree(tiny, out)
    (out / "config.json").write_text("{not json")
    return out


def _unsupported(tiny: Path, out: Path) -> Path:
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="nosuchmodel", architectures=["NoSuchModelForCausalLM"])
    (out / "config.json").write_text(json.dumps(config))
    return out


BROKEN_MODELS = {
    "missing": (lambda tiny, out: out, "does not exist"),
    "corrupt": (_corrupt, "is not a valid JSON file"),
    "unsupported": (_unsupported, "model type `nosuchmodel`"),
}


@pytest.mark.parametrize("kind", list(BROKEN_MODELS))
def test_a_model_that_fails_to_load_exits_1_with_one_clear_line(tiny_model_dir, tmp_path, kind):
    build, cause = BROKEN_MODELS[kind]
    model_dir = build(tiny_model_dir, tmp_path / kind)
    with ServeProcess(["--model-id", str(model_dir)]) as server:
        assert server.wait_exit() == 1, server.describe()
        [line] = failure_lines(server)
        assert line.startswith(f"lmiserve: model load failed: {kind}: "), line
        assert cause in line
        assert server.stderr_lines()[-1] == line  # the last word, after the shutdown's log
        assert_no_traceback(server)


def test_the_traceback_of_a_failed_load_is_logged_at_debug_level(tmp_path):
    with ServeProcess(["--model-id", str(tmp_path / "missing"), "--log-level", "debug"]) as server:
        assert server.wait_exit() == 1, server.describe()
        assert "Traceback" in server.stderr()
        assert server.stderr_lines()[-1].startswith("lmiserve: model load failed: missing: ")


def test_a_store_with_one_broken_model_exits_1_naming_it(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(tiny_model_dir, store / "good")
    _corrupt(tiny_model_dir, store / "broken")
    with ServeProcess(["--model-store", str(store)]) as server:
        assert server.wait_exit() == 1, server.describe()
        [line] = failure_lines(server)
        assert line.startswith("lmiserve: model load failed: broken: "), line
        assert_no_traceback(server)


# --- the port ------------------------------------------------------------------------------------------


def test_a_port_in_use_exits_3_with_one_line_before_loading_anything(tiny_model_dir):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)), ServeProcess(["--model-id", str(tiny_model_dir)], port=port) as s:
        assert s.wait_exit() == 3, s.describe()
        assert failure_lines(s) == [f"lmiserve: cannot listen on 127.0.0.1:{port}: Address already in use"]
        assert "Started server process" not in s.stderr()  # uvicorn never started, no model loaded
        assert_no_traceback(s)
