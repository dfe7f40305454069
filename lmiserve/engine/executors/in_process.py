"""The in-process executor: the model's runner in this process, each batch run on the calling thread (the
model's torch thread, engine/torch_thread.py). The other executor: engine/executors/tensor_parallel.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmiserve.engine.core.step import BatchRunner, Executor, Launched, StepBatch, StepOutput

if TYPE_CHECKING:
    import numpy as np


class InProcessExecutor(Executor):
    """The model in this process: each batch runs on the calling (torch) thread."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.num_blocks, self.block_size = runner.num_blocks, runner.block_size
        self.vocab_size, self.eos_token_ids = runner.vocab_size, runner.eos_token_ids
        self.kv_bytes = getattr(runner, "kv_bytes", 0)

    def execute(self, batch: StepBatch) -> StepOutput:
        return self.runner.execute_batch(batch)

    def launch(self, batch: StepBatch) -> Launched:
        return self.runner.launch_batch(batch)

    def collect(self, launched: Launched) -> StepOutput:
        return self.runner.collect(launched)

    @property
    def defers_masks(self) -> bool:
        return self.runner.defers_masks

    def sample_masked(self, rows: list[int], bitmask: np.ndarray | None) -> StepOutput:
        return self.runner.sample_masked(rows, bitmask)
