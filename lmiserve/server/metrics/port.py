"""`metrics_port`: /metrics alone on a port of its own, open (no API key), for a scraper on a network
that reaches that port and nothing else.

It runs in the serving process, on the same event loop, for as long as the app's lifespan: started
before the serving port opens, stopped when the app shuts down. The socket is bound at start-up, so a
port in use fails the start with the OS's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from lmiserve.server.sockets import bind_socket

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the serving one (which stops this one through the
    app's lifespan)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def metrics_app(answer: Callable[[], Response]) -> Starlette:
    async def metrics(request: Request) -> Response:
        return answer()

    async def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("Not Found: this port serves GET /metrics only", status_code=404)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])], exception_handlers={404: not_found})


@contextlib.asynccontextmanager
async def serving(
    answer: Callable[[], Response], host: str, port: int, log_level: str, keep_alive: int
) -> AsyncIterator[None]:
    """Serve `answer` at ``GET /metrics`` on host:port while the block runs (idle kept-alive connections
    closed after `keep_alive` seconds, as the main port's)."""
    sock = bind_socket(host, port)  # the main port's binding (TCP_NODELAY on its connections)
    config = uvicorn.Config(
        metrics_app(answer), lifespan="off", access_log=False, log_level=log_level, timeout_keep_alive=keep_alive
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="lmiserve-metrics-port")
    log.info("metrics on http://%s:%d/metrics", host, port)
    try:
        yield
    finally:
        server.should_exit = True
        await task
        sock.close()
