"""The serving process's side of `engine_process`: the `TextGenerator` (lmiserve.core.engine) of an engine
that runs in a process of its own (host.py), the protocols unchanged.

A thread reads the engine's messages (one a step) and hands each to the event loop, which puts every event on
its request's queue, tells the observers (metrics) what the engine told its own, and keeps the engine's last
`snapshot`. A request's iteration closed early aborts it there; the engine process exiting fails every open
request and tells the `on_failure` listeners, as an engine failure does in one process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from lmiserve.core import request_context
from lmiserve.core.errors import GenerationFailed, LmiServeError, ModelNotReady, ShuttingDown
from lmiserve.core.events import StepEvent
from lmiserve.core.request import GenerationRequest
from lmiserve.core.stats import EngineObserver, EngineSnapshot, notify, tell_failure
from lmiserve.core.tokenizer import tokenizing
from lmiserve.engine.core.kv_fits import check_fits
from lmiserve.engine.lora.registry import LoraLimits
from lmiserve.engine.process.adapters import Mirror, RemoteAdapters
from lmiserve.engine.process.wire import Ended, PipeSender, emit_forwarded
from lmiserve.engine.text.grammar_compiler import GrammarCompiler
from lmiserve.engine.text.validation import PromptCodec

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # how long `stop` waits for the engine process to end its requests and exit
MAX_GROUP = 64  # messages (steps) handed to the loop at once at most


def _record(ended: Ended) -> None:
    """What the engine ran for the request, added to the facts of the request being served (its spans)."""
    for generation in ended.generations:
        request_context.record_generation(generation)


class EngineProcessClient:
    """The engine in `process`, over `conn` (its `snapshot` as the engine's last message gave it); with LoRA
    adapters, `adapters` is its registry's `(limits, mirror, reserved names)` (process/adapters.py); `codec`:
    the model's prompt codec in this process (a text model's), which prepares and encodes requests here,
    and `grammars` its grammar compiler, which checks their grammars here."""

    def __init__(
        self,
        process: Any,
        conn: Connection,
        snapshot: EngineSnapshot,
        adapters: tuple[LoraLimits, Mirror, set[str]] | None = None,
        codec: PromptCodec | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.process, self._conn = process, conn
        self.codec, self.grammars = codec, grammars
        self._snapshot = snapshot
        self._observers: list[EngineObserver] = []
        self.on_failure: list[Callable[[str], None]] = []
        self.failure: str | None = None
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count(1)
        self._sender = PipeSender(conn)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.adapters = RemoteAdapters(self._send, *adapters) if adapters is not None else None

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            threading.Thread(target=self._read, name="lmiserve-engine-client", daemon=True).start()

    async def stop(self) -> None:
        """The engine ends its open requests (ShuttingDown) and its process exits; killed if it does not."""
        if self._stopping:
            return
        self._stopping = True
        self._send(("stop",))
        await asyncio.to_thread(self.process.join, STOP_GRACE_S)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %.0f s: killed", STOP_GRACE_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)
        self._end_all(ShuttingDown())
        self._conn.close()
        if self.grammars is not None:
            self.grammars.close()

    @property
    def num_waiting(self) -> int:
        return self._snapshot.waiting

    @property
    def num_running(self) -> int:
        return self._snapshot.running

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    # ---- requests ----------------------------------------------------------------------------------
    async def prepare(self, request: GenerationRequest) -> None:
        """The engine's `prepare` (its 4xx before a response starts). A text request is prepared here, with
        the codec: its prompt encoded (the protocol's count of it recalled: nothing is tokenized again) and
        checked, its KV checked against the pool the snapshot gives; the engine process then takes the ids
        (`generate`). A grammar is compiled here too (cached; the engine process compiles
        it again, from its own cache, as its requests arrive): its 4xx without a round trip to a busy engine
        process. Images go to the engine process's `prepare`."""
        self._check()
        codec, grammars, grammar = self.codec, self.grammars, request.params.grammar
        if codec is None or request.images or (grammar is not None and grammars is None):
            await self._call_prepare(request)
            return
        try:
            if grammar is not None and grammars is not None:
                await grammars.compile_async(grammar)
            ids = await tokenizing(codec.encode, request)
            snapshot = self._snapshot
            if snapshot.kv_block_size:  # (0: no paged pool)
                check_fits(len(ids) + request.params.max_new_tokens, snapshot.kv_blocks, snapshot.kv_block_size)
        except LmiServeError as exc:
            notify(self._observers, "on_rejected", exc)
            raise

    async def _call_prepare(self, request: GenerationRequest) -> None:
        assert self._loop is not None, "start() first"
        call = next(self._ids)
        self._calls[call] = reply = self._loop.create_future()
        self._send(("prepare", call, request))
        await reply

    def _encoded(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with its prompt's ids where this request already encoded its prompt (`prepare`, or the
        protocol's count): the engine process tokenizes nothing; else `request` (the engine encodes it)."""
        codec = self.codec
        if codec is None or request.prompt_ids is not None or request.images or not codec.tokenized(request):
            return request
        try:
            ids = codec.encode(request)  # recalled, and checked as the engine would
        except LmiServeError:
            return request  # the engine refuses it, as in one process
        return replace(request, prompt_ids=ids)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[StepEvent, None]:
        self._check()
        request = self._encoded(request)
        rid = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = queue
        self._send(("generate", rid, request))
        ended = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if isinstance(item, Ended):
                    ended = True
                    _record(item)
                    return
                yield item
        finally:
            self._queues.pop(rid, None)
            while not ended and not queue.empty():  # read to its last event: its end came in the same message
                item = queue.get_nowait()
                if isinstance(item, (Ended, BaseException)):
                    ended = True
                    if isinstance(item, Ended):
                        _record(item)
            if not ended:  # its client went away: the engine forgets it
                self._send(("abort", rid))

    def _check(self) -> None:
        if self.failure is not None:
            raise ModelNotReady(f"The model cannot serve: {self.failure}")
        if self._stopping:
            raise ShuttingDown()

    def _send(self, message: tuple[Any, ...]) -> None:
        self._sender.send(message)  # the engine process gone: `_lost` says so

    # ---- from the engine process ----------------------------------------------------------------------
    def _read(self) -> None:
        """Hand the engine's messages to the loop: every one waiting when the loop is behind, at once
        (`_dispatch`), so that a stream's tokens of several steps go out in one write."""
        loop = self._loop
        assert loop is not None
        while True:
            try:
                messages = [self._conn.recv()]
                while len(messages) < MAX_GROUP and self._conn.poll():
                    messages.append(self._conn.recv())
            except (EOFError, OSError):
                break
            if self.adapters is not None:  # answers to the adapters' calls here: a route may wait on the loop
                for message in [m for m in messages if m[0] == "adapters_reply"]:
                    self.adapters.answered(*message[1:])
                    messages.remove(message)
            if messages:
                loop.call_soon_threadsafe(self._dispatch, messages)
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._lost)

    def _dispatch(self, messages: list[tuple[Any, ...]]) -> None:
        """The engine's messages, in order. A request's events of several steps here are one burst (each but
        its last says `burst`: the response pipeline writes them together)."""
        delivered: dict[int, list[Any]] = {}
        for message in messages:
            kind = message[0]
            if kind == "batch":
                _, items, observed, self._snapshot, mirror = message
                if mirror is not None and self.adapters is not None:
                    self.adapters.mirror(mirror)
                for method, args in observed:
                    notify(self._observers, method, *args)
                for rid, item in items:
                    delivered.setdefault(rid, []).append(item)
            elif kind == "reply":
                _, call, error = message
                reply = self._calls.pop(call, None)
                if reply is not None and not reply.done():
                    if error is None:
                        reply.set_result(None)
                    else:
                        reply.set_exception(error)
            elif kind == "log":
                emit_forwarded(message[1])
            elif kind == "failure":
                self._fail(message[1])
        for rid, items in delivered.items():
            queue = self._queues.get(rid)
            if queue is None:
                continue
            last = len(items) - 1
            for n, item in enumerate(items):
                if n < last and isinstance(item, StepEvent) and isinstance(items[n + 1], StepEvent):
                    item = replace(item, burst=True)
                queue.put_nowait(item)

    def _lost(self) -> None:
        """The pipe closed: unless `stop` asked for it, the engine process died."""
        if self._stopping:
            return
        self.process.join(1.0)
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        why = f"the engine process (pid {self.process.pid}) {how}"
        self._fail(why, f"the engine failed: {why}")

    def _fail(self, why: str, error: str | None = None) -> None:
        """The engine failed for good: every open request ends with `error` (default: `why`), new ones are
        refused, and the `on_failure` listeners are told `why` (only the first failure counts)."""
        if self.failure is not None:
            return
        self.failure = why
        log.error("%s", why)
        self._end_all(GenerationFailed(error or why))
        tell_failure(self.on_failure, why)

    def _end_all(self, error: BaseException) -> None:
        if self.adapters is not None:
            self.adapters.fail(str(error) or type(error).__name__)
        for queue in self._queues.values():
            queue.put_nowait(error)
        for reply in self._calls.values():
            if not reply.done():
                reply.set_exception(error)
        self._calls.clear()
