"""The process lifecycle's decisions, without a process: which stop reason wins, which status, what
line. (tests/integration/test_signals.py drives the real process with real signals.)"""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from lmiserve.config import Settings
from lmiserve.models.registry import ModelRegistry
from lmiserve.models.service import ModelService
from lmiserve.server.lifecycle import ExitCode, Lifecycle
from lmiserve.server.sockets import bind_socket


def failed_service(name: str, error: str) -> ModelService:
    service = ModelService(Settings.from_options({}), name=name, kind="llm")
    service.status, service.error = ModelService.FAILED, error
    return service


def test_error_summary_is_the_first_paragraph_on_one_line():
    service = failed_service("m", "could not load\n  the model: bad\n\nYou can update Transformers with pip.")
    assert service.error_summary == "could not load the model: bad"


def test_a_startup_load_failure_stops_with_status_1_and_names_model_and_cause():
    lifecycle = Lifecycle()
    lifecycle.on_startup_load_failed(failed_service("tiny", "model path '/x' does not exist"))
    assert lifecycle.exit_code == ExitCode.MODEL_LOAD_FAILED == 1
    assert lifecycle.failure == "model load failed: tiny: model path '/x' does not exist"
    assert lifecycle.stop_reason == "model tiny failed to load"


def test_a_load_failure_after_a_stop_signal_keeps_the_clean_exit():
    lifecycle = Lifecycle()
    lifecycle.on_signal(signal.SIGTERM, None)
    lifecycle.on_startup_load_failed(failed_service("tiny", "cancelled by the stop"))
    assert (lifecycle.exit_code, lifecycle.failure, lifecycle.stop_reason) == (ExitCode.OK, None, "received SIGTERM")


def test_the_first_failure_is_the_one_reported():
    lifecycle = Lifecycle()
    lifecycle.on_startup_load_failed(failed_service("a", "first"))
    lifecycle.on_startup_load_failed(failed_service("b", "second"))
    assert lifecycle.failure == "model load failed: a: first"


def test_exit_codes_are_stable():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0,
        "MODEL_LOAD_FAILED": 1,
        "CONFIG_ERROR": 2,
        "CANNOT_LISTEN": 3,
        "ENGINE_FAILED": 4,
        "MODEL_DOWNLOAD_FAILED": 5,
    }


def test_bind_socket_raises_oserror_for_a_port_in_use():
    with bind_socket("127.0.0.1", 0) as held:
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match="in use"):
            bind_socket("127.0.0.1", port)


async def test_connections_accepted_on_the_bound_socket_send_without_delay():
    """asyncio sets TCP_NODELAY on the connections of a socket that says it is TCP: without it, an answer
    on a kept-alive connection waited ~40 ms (Nagle's algorithm against the client's delayed ACK)."""
    accepted: asyncio.Future[asyncio.BaseTransport] = asyncio.get_running_loop().create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)

    with bind_socket("127.0.0.1", 0) as sock:
        server = await asyncio.get_running_loop().create_server(Accept, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            transport = await asyncio.wait_for(accepted, 30)
            conn = transport.get_extra_info("socket")
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            transport.close()
            writer.close()


class _Loads(ModelService):
    def __init__(self, name: str, ok: bool) -> None:
        super().__init__(Settings.from_options({}), name=name, kind="llm")
        self.ok = ok

    async def load(self) -> None:
        self.status = self.READY if self.ok else self.FAILED


def test_load_all_reports_each_failed_model_once():
    failed: list[str] = []
    registry = ModelRegistry([_Loads("good", True), _Loads("bad", False), _Loads("worse", False)])
    asyncio.run(registry.load_all(on_failed=lambda s: failed.append(s.name)))
    assert sorted(failed) == ["bad", "worse"]


SAY_AFTER_A_BAR = """
import sys
from tqdm import tqdm
from lmiserve.server.lifecycle import exit_process, say
bar = tqdm(total=21, desc="Loading weights", file=sys.stderr, disable=False)
bar.update(1)
bar.refresh()
if sys.argv[1] == "closed":
    bar.close()
say("model load failed: broken: bad config")
exit_process(1)  # as the server exits: the bar's thread is not finalized
"""


@pytest.mark.parametrize("bar", ["open", "closed"])
def test_the_exit_line_is_a_line_of_its_own_after_a_progress_bar(bar):
    # A model store's other model may still be loading, its bar mid-line, when the line is written.
    import subprocess
    import sys

    err = subprocess.run(
        [sys.executable, "-c", SAY_AFTER_A_BAR, bar], capture_output=True, text=True, timeout=60
    ).stderr
    lines = err.splitlines()
    assert lines[-1] == "lmiserve: model load failed: broken: bad config", err
    assert "Loading weights" in err and "" not in lines[-2:], err  # the bar was drawn; no blank line added
