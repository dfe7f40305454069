"""An `Executor` whose model runs in a child process: the step contract's plain-data batches go to it
through a pipe (pickled) and its `StepOutput`s come back, so the engine core (scheduler, grammar
matchers, detokenizer, the HTTP loop) and the model's Python no longer share one GIL.

A benchmark's executor, not part of the package: `benchmarks/executor_process.py` measures it against
the in-process executor (docs/engine.md, "Thread, not process, for the engine core", has the figures); the
server keeps the model on the engine's thread. Importable as `benchmarks.process_executor` with the
repository root on `sys.path` (a spawned child must import it by that name). The child builds its runner with
`build`, a picklable callable run there (so the model loads in the child: `paged_fast_runner` takes the
loader from the caller, e.g. a `functools.partial` of `lmiserve.models.load.load_causal_lm`); the parent
must build the same pool (`num_blocks`, `block_size`) for its scheduler.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from lmiserve.engine.core.step import BatchRunner, Executor, StepBatch, StepOutput

if TYPE_CHECKING:
    from lmiserve.engine.loaded import LoadedModel


def paged_fast_runner(
    load: Callable[[], LoadedModel],
    num_blocks: int,
    block_size: int,
    max_slots: int,
    autotune: bool = False,
    autotune_cache: str | None = None,
) -> BatchRunner:
    """A `build` for `ProcessExecutor`: the model `load()` loads (picklable: a `functools.partial` of
    `lmiserve.models.load.load_causal_lm`, the model loaded as the server loads it), on the paged fast
    runner over a pool of `num_blocks` (the parent's)."""
    from lmiserve.engine.runner.fast import PagedFastRunner

    loaded = load()
    return PagedFastRunner(
        loaded.model,
        max_slots=max_slots,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        num_blocks=num_blocks,
        block_size=block_size,
        autotune=autotune,
        autotune_cache=autotune_cache,
    )


def _serve(conn: Connection, build: Callable[[], BatchRunner]) -> None:
    """The child: build the runner, answer its shape, then execute batches until the pipe closes."""
    runner = build()
    conn.send((runner.num_blocks, runner.block_size, runner.vocab_size, list(runner.eos_token_ids)))
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        try:
            conn.send(runner.execute_batch(batch))
        except Exception as exc:  # noqa: BLE001 - handed back to the engine, which fails the step
            conn.send(exc)


class ProcessExecutor(Executor):
    def __init__(self, build: Callable[[], BatchRunner], start_method: str = "spawn") -> None:
        context = mp.get_context(start_method)
        self._conn, child = context.Pipe()
        self._process: Any = context.Process(target=_serve, args=(child, build), daemon=True)  # type: ignore[attr-defined]
        self._process.start()
        child.close()
        num_blocks, self.block_size, self.vocab_size, self.eos_token_ids = self._conn.recv()
        if num_blocks is None:
            raise ValueError("a process executor needs a runner over a block KV cache")
        self.num_blocks = num_blocks

    def execute(self, batch: StepBatch) -> StepOutput:
        self._conn.send(batch)
        result = self._conn.recv()
        if isinstance(result, BaseException):
            raise result
        output: StepOutput = result
        return output

    def close(self) -> None:
        """Stop the child (it ends when the pipe closes)."""
        with contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(None)
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
