"""The engine's side of `engine_process`: one engine served over a pipe to the serving process (client.py).

A thread reads the serving process's messages and hands them to this process's event loop, where each
request is a task iterating `engine.generate`, exactly as the protocols do in one process. What the tasks
and the observers get during one turn of the loop is sent as one message: one a step. The engine's
scheduling, detokenizing and model steps so take none of the serving process's CPU or GIL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from lmiserve.core import request_context
from lmiserve.core.request import GenerationRequest
from lmiserve.core.stats import RequestStats, StepStats
from lmiserve.engine.core.async_engine import AsyncEngine
from lmiserve.engine.lora.registry import AdapterRegistry
from lmiserve.engine.process import adapters
from lmiserve.engine.process.wire import Ended, PipeSender, portable

log = logging.getLogger(__name__)


class _Forward:
    """The engine's observer here: each call is queued for the serving process's observers."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def on_rejected(self, error: BaseException) -> None:
        self.host.observed("on_rejected", (portable(error),))

    def on_submitted(self, prompt_tokens: int, sequences: int) -> None:
        self.host.observed("on_submitted", (prompt_tokens, sequences))

    def on_step(self, step: StepStats) -> None:
        self.host.observed("on_step", (step,))

    def on_finished(self, request: RequestStats) -> None:
        if request.error is not None:
            request = replace(request, error=portable(request.error))
        self.host.observed("on_finished", (request,))


class Host:
    """Serves `engine` (started, on this loop) over `conn` until told to stop or the serving process goes;
    `sender` sends on `conn` (shared with the process's log handler)."""

    def __init__(self, engine: AsyncEngine, conn: Connection, sender: PipeSender) -> None:
        self.engine, self.conn, self.sender = engine, conn, sender
        self.loop = asyncio.get_running_loop()
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._items: list[tuple[int, Any]] = []
        self._observed: list[tuple[str, tuple[Any, ...]]] = []
        self._flushing = False
        self._adapters_version = -1 if engine.adapters is None else engine.adapters.version  # the mirror sent
        self._stop = asyncio.Event()
        engine.add_observer(_Forward(self))
        engine.on_failure.append(self._failed)

    async def serve(self) -> None:
        threading.Thread(target=self._read, name="lmiserve-engine-pipe", daemon=True).start()
        await self._stop.wait()
        await self.engine.stop()  # the requests still open end with ShuttingDown, sent below
        tasks = list(self.tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        self._flush()

    def _failed(self, why: str) -> None:
        self._flush()  # the events the engine delivered before it failed go first
        self._send(("failure", why))

    # ---- from the serving process ------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the serving process went away
                break
            self.loop.call_soon_threadsafe(self._handle, message)
            if message[0] == "stop":
                return
        self.loop.call_soon_threadsafe(self._stop.set)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "generate":
            _, rid, request = message
            self.tasks[rid] = self.loop.create_task(self._generate(rid, request))
        elif kind == "abort":
            task = self.tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "prepare":
            _, call, request = message
            self.loop.create_task(self._prepare(call, request))
        elif kind == "adapters":
            self.loop.create_task(self._adapters_call(*message[1:]))
        elif kind == "stop":
            self._stop.set()

    async def _generate(self, rid: int, request: GenerationRequest) -> None:
        facts = request_context.RequestFacts(request.request_id or str(rid))
        request_context.bind(facts)  # this task's context: the engine records what it ran here
        try:
            async for event in self.engine.generate(request):
                self._put(rid, event)
            self._put(rid, Ended(tuple(facts.generations)))
        except asyncio.CancelledError:  # aborted: the serving process waits for nothing more
            pass
        except Exception as exc:  # noqa: BLE001 - the request's error, raised there from its iteration
            self._put(rid, portable(exc))
        finally:
            self.tasks.pop(rid, None)

    async def _prepare(self, call: int, request: GenerationRequest) -> None:
        error: BaseException | None = None
        try:
            await self.engine.prepare(request)
        except Exception as exc:  # noqa: BLE001 - raised by the serving process's `prepare`
            error = portable(exc)
        self._send(("reply", call, error))

    async def _adapters_call(self, number: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A change to the adapter registry (process/adapters.py), on a worker thread (it may read files);
        the answer carries the registry's mirror as the change left it."""
        registry = self.engine.adapters  # (the serving process calls only when the ready message had it)
        assert registry is not None
        result: Any
        try:
            result = await asyncio.to_thread(adapters.call, registry, method, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - raised by the serving process's call
            result = portable(exc)
        self._send(("adapters_reply", number, result, self._mirror(registry)))

    # ---- to the serving process ----------------------------------------------------------------------
    def observed(self, method: str, args: tuple[Any, ...]) -> None:
        self._observed.append((method, args))
        self._schedule()

    def _put(self, rid: int, item: Any) -> None:
        self._items.append((rid, item))
        self._schedule()

    def _schedule(self) -> None:
        """Flush two turns of the loop from now: a step's observers are told before its events are
        delivered, and the requests' tasks take their events in the turn after that (one message a step)."""
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self.loop.call_soon, self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if not self._items and not self._observed:
            return
        items, self._items = self._items, []
        observed, self._observed = self._observed, []
        registry, mirror = self.engine.adapters, None
        if registry is not None and registry.version != self._adapters_version:  # requests took or freed adapters
            mirror = self._mirror(registry)
        self._send(("batch", items, observed, self.engine.snapshot(), mirror))

    def _mirror(self, registry: AdapterRegistry) -> adapters.Mirror:
        """The registry's mirror for the serving process, its version noted as sent."""
        mirror = adapters.mirror_of(registry)
        self._adapters_version = mirror.version
        return mirror

    def _send(self, message: tuple[Any, ...]) -> None:
        self.sender.send(message)
