"""Dynamic batching for one-shot models (embeddings, classifiers, TorchScript): one queue per model.

Every request, whatever protocol carried it, is validated by the runner (`prepare`), then waits in the
model's queue. One background task takes the oldest request, gathers more requests with the same
tensor layout until `batch_size` rows or `max_batch_delay` seconds, runs ONE forward pass in a worker
thread and splits the outputs back by rows. A request larger than `batch_size` runs alone. If a
batched forward fails, its requests run one by one, so a bad request fails only itself. At most
`job_queue_size` requests wait; beyond that `submit` raises Overloaded.

A runner is a `TensorRunner`: `prepare` validates a request into arrays with rows on axis 0 (raising
InvalidRequest), `forward` runs them (blocking, on the torch thread).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from lmiserve.core.aio import cancel_and_wait
from lmiserve.core.errors import (
    GenerationFailed,
    InvalidRequest,
    LmiServeError,
    ModelNotReady,
    Overloaded,
)
from lmiserve.core.tensor_io import check_names, select_outputs
from lmiserve.core.tensors import ModelSignature, TensorRequest
from lmiserve.engine.torch_thread import for_device

if TYPE_CHECKING:
    import torch

Arrays = dict[str, npt.NDArray[Any]]  # named tensors, rows on axis 0
LayoutKey = tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape after the rows) per input

log = logging.getLogger(__name__)


class TensorRunner(Protocol):
    """A one-shot model: embeddings, classifier, TorchScript (oneshot/text.py, torchscript_runner.py)."""

    @property
    def kind(self) -> str: ...

    @property
    def signature(self) -> ModelSignature: ...

    @property
    def path(self) -> Path: ...

    @property
    def device(self) -> torch.device: ...

    def prepare(self, request: TensorRequest) -> Arrays:
        """The request's inputs checked and converted, rows on axis 0; InvalidRequest if they do not fit."""
        ...

    def forward(self, inputs: Arrays) -> Arrays:
        """One forward pass over a batch of prepared inputs (blocking); one output row per input row."""
        ...


@dataclass(frozen=True)
class BatchConfig:
    batch_size: int = 1  # most rows in one forward pass
    max_batch_delay: float = 0.1  # seconds the oldest request waits for the batch to fill
    job_queue_size: int = 1000


@dataclass(eq=False)  # identity: jobs are found in the queue by `is`, never by comparing arrays
class _Job:
    inputs: Arrays
    rows: int
    key: LayoutKey
    future: asyncio.Future[Arrays]
    arrival: float = field(default_factory=time.monotonic)


def layout_key(inputs: Arrays) -> LayoutKey:
    """Requests batch together when their tensors differ only in the number of rows."""
    return tuple((name, a.dtype.str, a.shape[1:]) for name, a in sorted(inputs.items()))


class OneShotModel:
    """The `TensorModel` of a one-shot runner, with its dynamic batcher."""

    def __init__(self, runner: TensorRunner, config: BatchConfig, name: str = "") -> None:
        self.runner = runner
        self.config = config
        self.name = name
        self.kind = runner.kind
        self.signature = runner.signature
        self.forwards = 0  # forward passes run (observability and tests)
        # the shared torch thread on the CPU, one of its own on a GPU (engine/torch_thread.py)
        self.thread = for_device(getattr(runner, "device", "cpu"), name or f"oneshot-{id(self):x}")
        self._queue: collections.deque[_Job] = collections.deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"lmiserve-oneshot-{self.name}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self.thread.close()
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(ModelNotReady("the model is being unloaded"))

    # ---- requests ----------------------------------------------------------------------------------
    async def infer(self, request: TensorRequest) -> Arrays:
        check_names(request.inputs, self.signature, self.name)
        inputs = self.runner.prepare(request)
        outputs = await self.submit(inputs)
        return select_outputs(outputs, request, self.signature)

    async def submit(self, inputs: Arrays) -> Arrays:
        """Queue prepared inputs (rows on axis 0) and await their outputs."""
        if self._task is None:
            raise ModelNotReady(f"Model {self.name} is not running")
        if len(self._queue) >= self.config.job_queue_size:
            raise Overloaded("Worker queue capacity exceeded")
        rows = {a.shape[0] if a.ndim else 1 for a in inputs.values()}
        if len(rows) != 1:
            raise InvalidRequest("all inputs must have the same number of rows (dimension 0)")
        job = _Job(inputs, rows.pop(), layout_key(inputs), asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._queue:
                self._queue.remove(job)
            raise

    # ---- the loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                batch = await self._next_batch()
                await self._run(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("one-shot batch of %s failed", self.name)
                await asyncio.sleep(0.01)

    async def _next_batch(self) -> list[_Job]:
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        first = self._queue[0]
        deadline = first.arrival + self.config.max_batch_delay
        while self._rows_like(first) < self.config.batch_size and first in self._queue:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                break
        return self._take()

    def _rows_like(self, first: _Job) -> int:
        return sum(j.rows for j in self._queue if j.key == first.key)

    def _take(self) -> list[_Job]:
        """The oldest job plus later same-layout jobs that fit in batch_size rows."""
        if not self._queue:
            return []
        first = self._queue.popleft()
        batch, rows = [first], first.rows
        for job in list(self._queue):
            if job.key == first.key and rows + job.rows <= self.config.batch_size:
                self._queue.remove(job)
                batch.append(job)
                rows += job.rows
        return batch

    async def _run(self, batch: list[_Job]) -> None:
        batch = [j for j in batch if not j.future.done()]  # the caller may have gone
        if not batch:
            return
        try:
            outputs = await self.thread.run(self._forward, [j.inputs for j in batch])
        except Exception as exc:  # noqa: BLE001 - answered per request below
            if len(batch) > 1:
                log.warning("batched forward of %d requests failed (%s); running them one by one", len(batch), exc)
                for job in batch:
                    await self._run([job])
                return
            _settle(batch[0], _as_error(exc))
            return
        start = 0
        for job in batch:
            _settle(job, {name: value[start : start + job.rows] for name, value in outputs.items()})
            start += job.rows

    def _forward(self, parts: list[Arrays]) -> Arrays:
        inputs = parts[0] if len(parts) == 1 else {n: np.concatenate([p[n] for p in parts]) for n in parts[0]}
        self.forwards += 1
        outputs = self.runner.forward(inputs)
        total = sum(next(iter(p.values())).shape[0] for p in parts)
        bad = [n for n, v in outputs.items() if np.ndim(v) == 0 or v.shape[0] != total]
        if bad:
            raise GenerationFailed(f"the model returned {bad[0]} without one row per input row ({total} rows)")
        return outputs


def _settle(job: _Job, result: Arrays | BaseException) -> None:
    if job.future.done():
        return
    if isinstance(result, BaseException):
        job.future.set_exception(result)
    else:
        job.future.set_result(result)


def _as_error(exc: Exception) -> LmiServeError:
    if isinstance(exc, LmiServeError):
        return exc
    return GenerationFailed(f"inference failed: {type(exc).__name__}: {exc}")
