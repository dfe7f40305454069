"""`engine_process`: the LLM and its engine core (scheduler, detokenizing, model steps) in a process of their
own, as vLLM's engine-core process, so that the serving process's event loop (HTTP, protocols, streaming)
and the engine do not share one GIL. The serving process keeps what the protocols read of the model (its
tokenizer, config, processor) and talks to the engine through `engine.process.client.EngineProcessClient`.

The engine process loads the model exactly as one process would (`compose.load_llm`), starts and warms up
its engine, then sends what the serving process needs of the model and serves the pipe until it is told to
stop (after the server drained) or its parent goes.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import pickle
import time
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmiserve.config import Settings
from lmiserve.core import heap, threads
from lmiserve.engine import torch_thread
from lmiserve.engine.codecs import grammar_compiler, text_codec
from lmiserve.engine.process.client import EngineProcessClient
from lmiserve.engine.process.wire import PipeLogHandler, PipeSender, emit_forwarded, portable
from lmiserve.models.compose import with_chat_template
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.vision import load_processor

if TYPE_CHECKING:
    from lmiserve.engine.loaded import LoadedModel

log = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # loading a large model and warming up its engine may take long; its exit does not wait


class ModelView:
    """What the serving process holds of the model in place of its weights: its configs."""

    def __init__(self, config: Any, generation_config: Any) -> None:
        self.config, self.generation_config = config, generation_config


def start_engine_process(settings: Settings, path: Path, name: str) -> tuple[LoadedModel, EngineProcessClient]:
    """Start the engine process of the LLM in `path` and wait until it serves (ModelLoadError with its
    reason when it does not); the model as the serving process sees it, and the engine's client."""
    from lmiserve.engine.loaded import LoadedModel

    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    process: Any = context.Process(
        target=engine_main,
        args=(settings, str(path), name, child, torch_thread.GOVERN),
        name="lmiserve-engine",
        daemon=False,  # a daemonic process may not start processes: its tensor-parallel ranks
    )
    process.start()
    _STARTED.add(process)  # at exit multiprocessing would wait for it, and it waits for us: `_kill_left`
    child.close()
    message = _first_message(conn, process)
    if message[0] != "ready":
        if process.is_alive():
            process.kill()
        process.join(5.0)
        conn.close()
        if len(message) > 2 and isinstance(message[2], Exception):  # what loading raised there, as in one process
            raise message[2]
        raise ModelLoadError(f"the engine process did not start: {message[1]}")
    _, view, snapshot = message
    model: Any = ModelView(view["config"], view["generation_config"])  # in place of the PreTrainedModel
    fields = view["fields"]
    if view["vision"]:  # a processor does not pickle: this process builds its own, as the engine's did
        fields["processor"] = load_processor(path, view["config"], settings.trust_remote_code)
        fields["tokenizer"] = fields["processor"].tokenizer
        with_chat_template(fields["tokenizer"], settings.chat_template)
    loaded = LoadedModel(model=model, **fields)
    log.info("engine process pid %d serves %s", process.pid, loaded.name)
    # a text model's prompts are encoded and checked here (their grammars compiled too), the engine process
    # given their ids
    codec = None if view["vision"] else text_codec(loaded, settings.max_input_len)
    grammars = grammar_compiler(loaded, codec) if codec is not None else None
    return loaded, EngineProcessClient(process, conn, snapshot, view["adapters"], codec, grammars)


def _first_message(conn: Connection, process: Any) -> tuple[Any, ...]:
    """The engine process's "ready" or "failed" (its log records before it are logged here)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        waited = wait([conn, process.sentinel], max(0.0, deadline - time.monotonic()))
        if conn not in waited:
            if waited:
                return ("failed", f"it exited with code {process.exitcode} while starting")
            return ("failed", "it did not start within the time allowed")
        try:
            message: tuple[Any, ...] = conn.recv()
        except (EOFError, OSError):
            process.join(5.0)
            return ("failed", f"it exited with code {process.exitcode} while starting")
        if message[0] == "ready_pickled":  # pickled in the engine process first, to report what fails to
            ready: tuple[Any, ...] = pickle.loads(message[1])
            return ready
        if message[0] != "log":
            return message
        emit_forwarded(message[1])


_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()  # the engine processes this process started


@atexit.register
def _kill_left() -> None:
    """The serving process exits with an engine process still running (a failed start, an exit that did
    not stop the engine): it is killed, as a daemonic process would be (it ignores SIGTERM)."""
    for process in list(_STARTED):
        if process.is_alive():
            process.kill()
            process.join(5.0)


def engine_main(settings: Settings, path: str, name: str, conn: Connection, govern: bool) -> None:
    """The engine process: load, start, warm up, tell the serving process, serve. As every child of the
    server (engine/child_process.py) it ignores SIGINT and SIGTERM and exits when its parent goes."""
    from lmiserve.engine.child_process import start_child

    sender = PipeSender(conn)
    # the records go to the serving process, which writes them as its own (log_format, request ids)
    start_child(settings.log_level, threads.choose(settings.num_threads).threads, handlers=[PipeLogHandler(sender)])
    torch_thread.GOVERN = govern
    asyncio.run(_serve(settings, Path(path), name, conn, sender))


async def _serve(settings: Settings, path: Path, name: str, conn: Connection, sender: PipeSender) -> None:
    from lmiserve.engine.core.warmup import warm_up
    from lmiserve.engine.process.adapters import mirror_of
    from lmiserve.engine.process.host import Host
    from lmiserve.models.compose import load_served_llm

    # the model, or its shell with tensor-parallel workers (this process's children) holding the weights; the
    # LoRA registry is this process's (engine/process/adapters.py)
    try:
        loaded, engine = await torch_thread.run_apart(load_served_llm, settings, path, name)
        engine.start()
        await warm_up(engine)
    except Exception as exc:  # noqa: BLE001 - the serving process reports it and the model is FAILED
        log.debug("the engine failed to start", exc_info=exc)
        sender.send(("failed", f"{type(exc).__name__}: {exc}", portable(exc)))
        return
    try:
        view = _view(loaded)
        registry = engine.adapters  # LoRA: the registry's limits and mirror (engine/process/adapters.py)
        view["adapters"] = (
            (registry.limits, mirror_of(registry), set(registry.reserved)) if registry is not None else None
        )
        ready = pickle.dumps(("ready", view, engine.snapshot()))
    except Exception as exc:  # noqa: BLE001 - what the serving process needs of the model does not pickle
        sender.send(("failed", f"the model's tokenizer or config cannot be sent to the server: {exc}"))
        return
    heap.freeze()  # the engine process's model and engine, out of the collector's way (core/heap.py)
    sender.send(("ready_pickled", ready))
    await Host(engine, conn, sender).serve()


def _view(loaded: LoadedModel) -> dict[str, Any]:
    """What the serving process needs of `loaded` (picklable: no weights)."""
    model = loaded.model
    fields = {
        "tokenizer": loaded.tokenizer,
        "device": loaded.device,
        "dtype": loaded.dtype,
        "max_context": loaded.max_context,
        "eos_token_ids": loaded.eos_token_ids,
        "name": loaded.name,
        "path": loaded.path,
    }
    config, generation = model.config, getattr(model, "generation_config", None)
    return {"config": config, "generation_config": generation, "fields": fields, "vision": loaded.processor is not None}
