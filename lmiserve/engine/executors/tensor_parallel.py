"""Tensor-parallel execution, the leader's side (the workers: engine/executors/tp_worker.py): one process a rank (one
a device), the model's shard in each (engine/model/sharding.py), joined in a torch.distributed group (NCCL
on CUDA, gloo on CPU).

The engine core stays in the serving process (the leader): it plans every step as plain data
(engine/core/step.py) and `TensorParallelExecutor` sends the batch to rank 0 over a pipe; rank 0 broadcasts
it to every rank over a gloo group (`broadcast_object_list`), every rank runs it (the all-reduces and the
logits' all-gather inside the forward), and rank 0 answers with its `StepOutput`. Every rank samples from
the same gathered logits, so no token needs sending back to the others: the next batch carries them.

Overlap scheduling (`async_scheduling`): `launch` sends a batch and returns without its answer, so the engine
plans and sends the next one while the ranks run this one; `collect` takes the answers in the order the batches
went. The ranks launch a batch that arrives while the step before it runs on the device behind that step
(engine/executors/tp_steps.py): neither the pipe nor the host's planning sits between two steps on the GPUs.

Across nodes the ranks are ``node_rank * local + i``: node 0 (the leader) serves HTTP and starts its
local ranks with this executor; every other node runs `run_node` (no HTTP) which starts its own and
waits. They meet at ``master_addr:master_port`` (torchrun's rendezvous variables).

LoRA: the leader's adapter registry checks and counts adapters against the model's shell (no weights);
every rank reads its shard of an adapter from the folder a batch names (engine/executors/tp_worker.py), so an
adapter's folder must be readable at the same path by every rank (on several nodes: a shared file system).

Faults: a worker that exits, or a step that answers not within `step_timeout`, is `ExecutorFailed`
(the engine fails, the server turns unhealthy and exits non-zero). In a worker any exception of a step
is fatal (its ranks' collectives would no longer pair up). Workers ignore SIGINT and SIGTERM (the
leader drains, then closes them) and exit when their parent process goes away.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, NoReturn

from lmiserve.engine.core.step import Executor, ExecutorFailed, Launched, StepBatch, StepOutput

if TYPE_CHECKING:
    import numpy as np

from lmiserve.engine.executors.tp_worker import WorkerSpec, worker_main

__all__ = ["TensorParallelExecutor", "WorkerSpec", "free_port", "run_node"]

log = logging.getLogger(__name__)

CAUSE_WAIT_S = 0.5  # how long rank 0's error waits for another worker's exit that caused it
HEARTBEAT_S = 5.0  # with several nodes: an empty batch after this long without a step (`watch`)


def free_port() -> int:
    """A TCP port free on this host now (for a one-node group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# ---- the leader's side -----------------------------------------------------------------------------
def _start_workers(spec: WorkerSpec, conn: Connection | None) -> list[Any]:
    """This node's ranks as spawned processes (rank 0, on the leader's node, gets `conn`)."""
    context = mp.get_context("spawn")
    processes = []
    for local_rank, rank in enumerate(spec.local_ranks):
        process: Any = context.Process(
            target=worker_main,
            args=(spec, rank, local_rank, conn if rank == 0 else None),
            name=f"lmiserve-tp-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


_REAPING = threading.Lock()  # one thread reaps a worker (another's waitpid would find no child: no status)


def _stop(processes: list[Any], grace: float) -> None:
    """Wait up to `grace` seconds for `processes` to end, then kill the rest; every one is reaped."""
    deadline = time.monotonic() + grace
    with _REAPING:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _exit_text(process: Any) -> str:
    with _REAPING:
        process.join(1.0)  # its sentinel is ready: the exit status comes with the reaping
        code = process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel worker rank {process.name.removeprefix('lmiserve-tp-rank')} (pid {process.pid}) {how}"


class TensorParallelExecutor(Executor):
    """The leader's executor: this node's ranks as worker processes, batches through rank 0."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.node_rank != 0:
            raise ValueError("the tensor-parallel executor runs on node 0 (the others run `run_node`)")
        self.spec = spec
        self._conn, child = mp.get_context("spawn").Pipe()
        self._processes = _start_workers(spec, child)
        child.close()
        self._closing = False
        self._failed = False  # a worker died or hung: the others are killed, not asked, at close
        self._lock = threading.Lock()  # one message sent, or one answer awaited, at a time; close after it
        self._last_step = time.monotonic()  # when the last step (or heartbeat) ended
        # the messages sent and answered (rank 0 answers in order), the answers taken before they were awaited
        self._sent = self._answered = 0
        self._answers: dict[int, StepOutput] = {}
        self._failure = ""  # why the executor failed (every later step fails with it)
        self.sent_ahead = 0  # batches sent while the one before them was unanswered (overlap scheduling)
        try:
            kind, info = self._receive(None)
        except ExecutorFailed as exc:
            self._failed = True
            self.close()
            raise ValueError(f"tensor parallelism did not start: {exc}") from None
        if kind != "ready":
            self.close()
            raise ValueError(f"tensor parallelism did not start: {info}")
        self.num_blocks, self.block_size, self.vocab_size, self.eos_token_ids, rank_bytes, sizes = info
        # the decode graphs' sizes (every rank's the same; None: eager steps), which the engine's warm-up runs
        self.graph_sizes: tuple[int, ...] | None = sizes
        self.kv_bytes = rank_bytes * spec.world  # every rank's pool (rank 0's shape)
        log.info(
            "tensor parallelism: %d ranks (%d on this node), %d KV blocks of %d tokens",
            spec.world,
            spec.local_world,
            self.num_blocks,
            self.block_size,
        )

    def _receive(self, timeout: float | None) -> tuple[str, Any]:
        """Rank 0's next message; ExecutorFailed if a worker of this node exits first or none comes
        within `timeout` seconds."""
        sentinels = {process.sentinel: process for process in self._processes}
        ready = wait([self._conn, *sentinels], timeout)
        if self._conn in ready:
            try:
                message: tuple[str, Any] = self._conn.recv()
                return message
            except (EOFError, OSError):
                pass
        for key in ready:
            if key in sentinels:
                raise ExecutorFailed(_exit_text(sentinels[key]))
        if not ready:
            raise ExecutorFailed(
                f"a step ran past step_timeout={self.spec.step_timeout:g} s (a tensor-parallel worker hangs)"
            )
        raise ExecutorFailed("tensor-parallel rank 0 closed its pipe")

    def execute(self, batch: StepBatch) -> StepOutput:
        return self._await(self._send(("step", batch, True)))

    def launch(self, batch: StepBatch) -> Launched:
        """The batch sent to the ranks, its answer awaited by `collect` (the engine may plan and send the next one
        meanwhile, which the ranks then launch behind it: engine/executors/tp_steps.py)."""
        return Launched(StepOutput(), self._send(("step", batch, False)))

    def collect(self, launched: Launched) -> StepOutput:
        output = self._await(launched.pending)
        for seq_id, message in launched.output.errors.items():  # (rows that failed at the launch: `fail_rows`)
            output.samples.pop(seq_id, None)
            output.errors[seq_id] = message
        return output

    @property
    def defers_masks(self) -> bool:
        return True  # (every rank holds the rows and samples them when the masks come)

    def sample_masked(self, rows: list[int], bitmask: np.ndarray | None) -> StepOutput:
        return self._await(self._send(("masks", rows, bitmask)))

    def _send(self, message: tuple[str, StepBatch, bool] | tuple[str, list[int], np.ndarray | None]) -> int:
        """`message` to every rank (through rank 0); its number in the order of the answers."""
        with self._lock:
            if self._closing or self._failure:
                raise ExecutorFailed(self._failure or "the tensor-parallel workers are closed")
            try:
                self._conn.send(message)
            except OSError as exc:
                self._fail(f"tensor-parallel rank 0 is gone: {exc}")
            self._sent += 1
            self.sent_ahead += self._sent - self._answered > 1
            return self._sent

    def _await(self, number: int) -> StepOutput:
        """Rank 0's answer to message `number` (those before it kept for their own awaits)."""
        with self._lock:
            while number not in self._answers:
                if self._failure:
                    raise ExecutorFailed(self._failure)
                try:
                    kind, info = self._receive(self.spec.step_timeout)
                except ExecutorFailed as exc:
                    self._fail(str(exc))
                finally:
                    self._last_step = time.monotonic()
                if kind != "ok":
                    self._fail(self._cause(info))
                self._answered += 1
                self._answers[self._answered] = info
            return self._answers.pop(number)

    def _fail(self, why: str) -> NoReturn:
        self._failed, self._failure = True, why
        raise ExecutorFailed(why)

    def _cause(self, error: str) -> str:
        """Rank 0's `error`, led by the exit of another worker of this node that ended at about the same
        time (a collective with a killed rank fails on rank 0 first: the killed rank is the cause)."""
        others = [process for process in self._processes if process.name != "lmiserve-tp-rank0"]
        ready = wait([process.sentinel for process in others], CAUSE_WAIT_S) if others else []
        dead = [process for process in others if process.sentinel in ready]
        return f"{_exit_text(dead[0])} ({error})" if dead else error

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """This node's workers by their process sentinels; with several nodes, the others' by a heartbeat:
        an empty batch every `HEARTBEAT_S` seconds without a step, which every rank receives (a rank that
        is gone fails rank 0's broadcast; one that hangs, `step_timeout`)."""

        def sentinels() -> None:
            ready = wait([process.sentinel for process in self._processes])
            if self._closing:
                return
            self._failed = True
            for process in self._processes:
                if process.sentinel in ready:
                    on_failure(_exit_text(process))
                    return

        def heartbeat() -> None:
            while not self._closing:
                time.sleep(min(1.0, HEARTBEAT_S))
                if self._closing or time.monotonic() - self._last_step < HEARTBEAT_S:
                    continue
                try:
                    self.execute(StepBatch())
                except ExecutorFailed as exc:
                    if not self._closing:
                        on_failure(str(exc))
                    return

        threading.Thread(target=sentinels, name="lmiserve-tp-watch", daemon=True).start()
        if self.spec.nnodes > 1:
            threading.Thread(target=heartbeat, name="lmiserve-tp-heartbeat", daemon=True).start()

    def close(self) -> None:
        """Tell the workers to stop (after the step in flight), then reap them (killed after 10 s; at once
        when the executor failed: a group with a dead or hung rank stops no other way)."""
        self._closing = True
        acquired = self._lock.acquire(timeout=self.spec.step_timeout)
        try:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._conn.close()
        finally:
            if acquired:
                self._lock.release()
        _stop(self._processes, 0.0 if self._failed else 10.0)


# ---- the other nodes -------------------------------------------------------------------------------
def run_node(spec: WorkerSpec) -> int:
    """A node other than the leader: start its ranks and wait for them. 0 when they all stopped cleanly
    (the leader closed them) or SIGTERM/SIGINT stopped them; 4 (the engine failed) when one failed, the
    others then killed."""
    processes = _start_workers(spec, None)
    stopping = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stopping.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    log.info("node %d of %d: ranks %s started", spec.node_rank, spec.nnodes, list(spec.local_ranks))

    def one_failed() -> bool:
        return any(process.exitcode not in (None, 0) for process in processes)

    try:
        while not stopping.is_set() and any(process.is_alive() for process in processes) and not one_failed():
            wait([process.sentinel for process in processes], 1.0)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(processes, 0.0 if stopping.is_set() or one_failed() else 10.0)  # the rest killed at once
    if stopping.is_set():
        return 0
    failed = [process for process in processes if process.exitcode != 0]
    for process in failed:
        log.error("%s", _exit_text(process))
    return 4 if failed else 0
