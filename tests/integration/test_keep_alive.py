"""How long `lmiserve serve` keeps an idle kept-alive connection (`keep_alive_timeout`, lmiserve/server/lifecycle.py).

uvicorn's own default (5 s) equals httpx's pool expiry: a benchmark of 128 streaming clients over kept-alive
connections (`lmiserve bench`, the GPU check) saw a request fail now and then with "Connection reset by peer"
when the server closed an idle connection just as the client reused it (2 in 3,072 requests on the tiny model,
none in 4,608 with the server waiting longer). The default is now longer than the idle timeouts in front
of it (AWS ALB 60 s, httpx 5 s), so the client closes idle connections; the option reaches uvicorn.
"""

from __future__ import annotations

import http.client
import time

import pytest

from helpers.serve_process import HANG_TIMEOUT, ServeProcess
from helpers.server import free_port
from lmiserve.config import ConfigError, Settings
from lmiserve.config.sources import load_settings


def idle_until_closed(url_host: str, port: int, path: str = "/ping") -> float:
    """Seconds from a kept-alive answer on a fresh connection until the server closes that connection."""
    conn = http.client.HTTPConnection(url_host, port, timeout=HANG_TIMEOUT)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        assert response.getheader("connection", "").lower() != "close"  # kept alive
        assert conn.sock is not None
        start = time.monotonic()
        assert conn.sock.recv(1) == b""  # the server's close (a hang here fails at HANG_TIMEOUT)
        return time.monotonic() - start
    finally:
        conn.close()


def test_an_idle_connection_is_closed_after_keep_alive_timeout(tiny_model_dir):
    """On the serving port and on `metrics_port` (a uvicorn server of its own) alike."""
    metrics = free_port("127.0.0.1")
    options = ["keep_alive_timeout=1", "grpc_port=0", f"metrics_port={metrics}"]
    with ServeProcess(["--model-id", str(tiny_model_dir), *(a for o in options for a in ("-o", o))]) as server:
        server.wait_healthy()
        waited = [idle_until_closed(server.host, server.port), idle_until_closed(server.host, metrics, "/metrics")]
    assert all(0.8 <= w < 4 for w in waited), waited  # uvicorn's own 5 s would be the option ignored


def test_the_default_outlasts_load_balancers_and_client_pools():
    assert Settings().keep_alive_timeout > 60  # AWS ALB's default idle timeout; httpx's pool expiry is 5 s


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75"}, 75.0), ({"OPTION_KEEP_ALIVE_TIMEOUT": "90"}, 90.0)],
)
def test_vllms_variable_and_lmis_set_it(env, expected):
    assert load_settings(environ=env).keep_alive_timeout == expected


def test_a_non_positive_timeout_is_refused():
    with pytest.raises(ConfigError, match="keep_alive_timeout"):
        load_settings(environ={"OPTION_KEEP_ALIVE_TIMEOUT": "0"})
