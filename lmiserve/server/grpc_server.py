"""The gRPC port (`grpc_port`, default 8081; 0 = off): a `grpc.aio` server in the event loop of the HTTP
server, over the same models (the servicers come from the protocols, wired by `server/app.py`).

Its life follows the HTTP port's (lmiserve.server.lifecycle):

- **bind** right after the HTTP port, before any model loads: `probe` binds it once in `Lifecycle.serve`
  (a port in use exits `CANNOT_LISTEN` with one line), then `start` binds it for good as the event loop
  starts (SO_REUSEPORT off: a second server on the same port fails instead of sharing it);
- **serve**: every call passes `Calls` first, as every REST route passes `server.guard`: the drain
  (UNAVAILABLE, but `ServerLive`), the API key (``authorization: Bearer <key>`` metadata, as REST's
  ``Authorization`` header; UNAUTHENTICATED), the sizes (`max_request_size` is grpc's largest message
  received, `max_header_size` its largest metadata: RESOURCE_EXHAUSTED); then each call (each request
  of a stream) gets its `RequestFacts`, its trace span (`tracing.rpc_span`) and its access line, with
  the gRPC status code as its status (0 = OK) and the route `/inference.GRPCInferenceService/<RPC>`;
- **drain**: from the first SIGTERM new calls get UNAVAILABLE while the calls in flight (the requests
  of open streams) run on, up to `drain_timeout` with the HTTP requests (`in_flight`);
- **stop**: then `stop` closes the port, ending what still runs (STOP_GRACE seconds at most).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from lmiserve.core import request_context
from lmiserve.core.errors import InternalError, LmiServeError, ShuttingDown, Unauthorized
from lmiserve.core.request_context import RequestFacts, new_request_id, usable_request_id
from lmiserve.server import tracing
from lmiserve.server.access import ID_HEADERS, write_access_line
from lmiserve.server.auth import bearer_matches
from lmiserve.server.sockets import bind_socket

if TYPE_CHECKING:
    from lmiserve.config import Settings
    from lmiserve.models.registry import ModelRegistry
    from lmiserve.server.drain import Drain

log = logging.getLogger(__name__)

T = TypeVar("T")
CLOSING = object()  # put on an open stream's queue when the port closes (GrpcHost.close_streams)
MAX_MESSAGE = 2**31 - 1  # grpc's message size options are C ints
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
OK = grpc.StatusCode.OK.value[0]


class Access(Enum):
    """What a call needs (`lmiserve.server.guard.Access`, for RPCs)."""

    LIVE = "live"  # the liveness RPC: no key, answers while the server drains
    OPEN = "open"  # readiness RPCs: no key
    KEY = "key"  # everything else: the API key when one is set


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def options(settings: Settings) -> list[tuple[str, int]]:
    """The server's channel options: no shared port, REST's size limits."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", min(settings.max_request_size, MAX_MESSAGE)),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_metadata_size", min(settings.max_header_size, MAX_MESSAGE)),
    ]


def metadata_of(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """A call's metadata by (lower-case) key, text values only (the first of a repeated key)."""
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str) and key not in out:
            out[key] = value
    return out


class GrpcHost:
    """What the gRPC port's servicers share: the server's options, its models, its drain, and the calls
    in flight (every servicer's: the drain waits for them)."""

    def __init__(self, settings: Settings, registry: ModelRegistry, drain: Drain) -> None:
        self.settings = settings
        self.registry = registry
        self.drain = drain
        self.open: set[asyncio.Task[Any]] = set()  # the calls (and stream requests) in flight
        self.streams: set[asyncio.Queue[Any]] = set()  # each open stream's queue: `close_streams` tells them

    def calls(
        self, protocol: str, code_of: Callable[[LmiServeError], grpc.StatusCode], probes: Sequence[str] = ()
    ) -> Calls:
        """The plumbing of one service's calls: `protocol` is its name in access lines and spans, `code_of`
        the status code of a neutral error, `probes` the methods that are health probes (their access lines
        are DEBUG, they are not traced)."""
        return Calls(self, protocol, code_of, probes)

    def in_flight(self) -> list[asyncio.Task[Any]]:
        return [task for task in self.open if not task.done()]

    def close_streams(self) -> None:
        """Tell every open stream the port closes: each ends (UNAVAILABLE) once its requests are answered."""
        for queue in self.streams:
            queue.put_nowait(CLOSING)


class Calls:
    """What every RPC of one service passes, and what it gets: see the module docstring. The servicers
    reach the models through `registry` and the server's options through `settings`."""

    def __init__(
        self,
        host: GrpcHost,
        protocol: str,
        code_of: Callable[[LmiServeError], grpc.StatusCode],
        probes: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.settings = host.settings
        self.registry = host.registry
        self.drain = host.drain
        self.protocol = protocol
        self.code_of = code_of
        self.probes = frozenset(probes)
        keys = (self.settings.request_id_header_key, *ID_HEADERS)
        self._id_keys = list(dict.fromkeys(k.lower() for k in keys))

    # ---- admission ---------------------------------------------------------------------------------
    def admit(self, metadata: Mapping[str, str], access: Access) -> None:
        """Raises `ShuttingDown` while the server drains (but for `LIVE`), `Unauthorized` without the key."""
        if access is not Access.LIVE and self.drain.active:
            raise ShuttingDown()
        key = self.settings.api_key
        if access is Access.KEY and key and not bearer_matches(metadata.get("authorization", ""), key):
            raise Unauthorized("missing or wrong API key")

    def request_id(self, metadata: Mapping[str, str], sent: str | None = None) -> str:
        """`sent` (a stream request's id) if usable, else the call's ``x-request-id`` metadata (or the
        configured header's), else a new one."""
        for value in (sent, *(metadata.get(k) for k in self._id_keys)):
            if value is not None and usable_request_id(value.strip()):
                return value.strip()
        return new_request_id()

    # ---- one call, or one request of a stream -------------------------------------------------------
    @contextlib.contextmanager
    def served(
        self, method: str, metadata: Mapping[str, str], model: str | None = None, request_id: str | None = None
    ) -> Iterator[RequestFacts]:
        """The facts of one call (or stream request) of `method` (``/<service>/<RPC>``), bound for its life,
        in flight for the drain, in its span, logged at the end. The caller sets ``facts.status`` (the gRPC
        code) before leaving; an exception leaving sets CANCELLED or INTERNAL."""
        facts = RequestFacts(self.request_id(metadata, request_id), method="POST", path=method)
        facts.route, facts.protocol, facts.model = method, self.protocol, model
        token = request_context.bind(facts)
        task = asyncio.current_task()
        if task is not None:
            self.host.open.add(task)
        probe = method in self.probes
        span = contextlib.nullcontext() if probe else tracing.rpc_span(self.protocol, method, model, _traced(metadata))
        try:
            with span:
                try:
                    yield facts
                except asyncio.CancelledError:
                    facts.disconnected = True
                    if facts.status is None:
                        facts.status = CANCELLED
                    raise
                except BaseException:
                    if facts.status is None:
                        facts.status = INTERNAL
                    raise
                finally:
                    facts.end = time.monotonic()
        finally:
            write_access_line(facts, probe)
            request_context.unbind(token)
            if task is not None:
                self.host.open.discard(task)

    async def unary(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        model: str | None,
        work: Callable[[], Awaitable[T]],
        access: Access = Access.KEY,
    ) -> T:
        """Run a unary call's `work` after admission; a neutral error (or an unforeseen one, logged)
        aborts the call with its status code and message."""
        metadata = metadata_of(context)
        error: LmiServeError | None = None
        with self.served(method, metadata, model) as facts:
            await _echo_id(context, facts.request_id)
            try:
                self.admit(metadata, access)
                result = await work()
                facts.status, facts.completed = OK, True
            except LmiServeError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - an unforeseen failure is INTERNAL with a message, never UNKNOWN
                log.exception("unhandled error in %s", method)
                error = InternalError(str(exc) or type(exc).__name__)
            if error is not None:
                facts.status = self.code_of(error).value[0]
        if error is not None:
            await context.abort(self.code_of(error), error.message)
        return result


async def _echo_id(context: grpc.aio.ServicerContext, request_id: str) -> None:
    """The call's request id in its initial metadata (``x-request-id``), as REST echoes it in a header."""
    with contextlib.suppress(Exception):  # noqa: BLE001 - a call already ended cannot take metadata
        await context.send_initial_metadata((("x-request-id", request_id),))


def _traced(metadata: Mapping[str, str]) -> dict[str, str]:
    """What a span may read of a call's metadata: never its key."""
    return {k: v for k, v in metadata.items() if k != "authorization"}


# What a servicer module gives to be served: adds its services to the server, over the port's host.
AddServices = Callable[[grpc.aio.Server, GrpcHost], None]


class GrpcServer:
    """The gRPC port of `lmiserve serve` (see the module docstring)."""

    def __init__(self, settings: Settings, registry: ModelRegistry, drain: Drain, add: Sequence[AddServices]):
        self.settings = settings
        self.host = GrpcHost(settings, registry, drain)
        self._add = add
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    @staticmethod
    def probe(host: str, port: int) -> None:
        """Bind host:port once and let it go: OSError (with the system's reason) when it cannot be bound,
        before any model loads and before grpc logs a failure of its own."""
        bind_socket(host, port).close()

    async def start(self) -> int:
        """Bind and serve (in the running event loop); OSError when the port cannot be bound."""
        server = grpc.aio.server(options=options(self.settings))
        for add in self._add:
            add(server, self.host)
        where = address(self.settings.host, self.settings.grpc_port)
        try:
            port = server.add_insecure_port(where)
        except RuntimeError as exc:  # grpc says only "Failed to bind": the system's reason comes from a probe
            try:
                self.probe(self.settings.host, self.settings.grpc_port)
            except OSError as reason:
                raise reason from exc
            raise OSError(f"cannot bind {where}") from exc
        await server.start()
        self._server, self.port = server, port
        return port

    def in_flight(self) -> list[asyncio.Task[Any]]:
        """The calls in flight (the requests of open streams), which the drain waits for."""
        return self.host.in_flight()

    async def stop(self, grace: float) -> None:
        """Close the port: calls still running get `grace` seconds, then are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            self.host.close_streams()
            await server.stop(grace)
