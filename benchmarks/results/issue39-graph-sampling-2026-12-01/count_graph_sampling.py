"""What the host does for a sampled decode step on a GPU's graph path (issue #39), with the rows sampled
inside the decode graph (engine/runner/graph_sampling.py) against sampled after it from its logits
(`graph_sampling.USE_IN_GRAPHS` off, the path before). Counted on this CPU with the graphs' step run from
their buffers without a capture (as the tests run it) and the sampler on the GPU's path (`_at_once`, the draw
kernel): 32 seeded streams at temperature 1.0 and top_p 0.9 through an engine with overlap scheduling, the
tests' tiny Llama. Per decode step of the 32 rows:

- aten ops the runner dispatches outside the graph's own step (on a GPU each one with a kernel is a launch;
  the graph's step is one replay), the draw kernel counted as one launch (a stub fills its outputs);
- host waits in the runner's step (a value read from the device), outside the graph's step;
- whether the step chained from the step before on the device (its rows' inputs the last step's tokens,
  launched before the host received them: overlap scheduling).

    PYTHONPATH=. python benchmarks/results/issue39-graph-sampling-2026-12-01/count_graph_sampling.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton attention of the graphs' step, on this CPU
os.environ["LMISERVE_ATTENTION_BACKEND"] = "triton"
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.capture_hazards import Hazards, watch  # noqa: E402
from helpers.tiny_model import build_tiny_model_dir  # noqa: E402
from lmiserve.core.request import GenerationRequest, SamplingParams  # noqa: E402
from lmiserve.engine.attention import cuda_graphs  # noqa: E402
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs  # noqa: E402
from lmiserve.engine.core.async_engine import EngineConfig  # noqa: E402
from lmiserve.engine.factory import create_engine  # noqa: E402
from lmiserve.engine.runner import graph_sampling, sampling, seeded_draw  # noqa: E402
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner  # noqa: E402
from lmiserve.models.load import load_causal_lm  # noqa: E402

STREAMS, TOKENS = 32, 40


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Launch:
    """The draw kernel's launch, its outputs filled outside the count (token 0 of each part, valid rows)."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(probs: Any, keys: Any, index: Any, best: Any, where: Any, total: Any, least: Any, *a: Any, **k: Any):
            with _disable_current_modes():
                best.fill_(1.0), where.zero_(), total.fill_(1.0), least.zero_()

        return launch


async def serve(loaded: Any, sampled: bool = True) -> None:
    engine = create_engine(loaded, EngineConfig(max_running=STREAMS, max_prefill_tokens=512, async_scheduling=True))
    engine.start()

    async def one(i: int) -> None:
        options = {"do_sample": True, "top_p": 0.9} if sampled else {}
        params = SamplingParams(max_new_tokens=TOKENS, ignore_eos_token=True, seed=i, **options)
        async for _ in engine.generate(GenerationRequest(f"Stream {i} says", params)):
            pass

    try:
        await asyncio.gather(*(one(i) for i in range(STREAMS)))
    finally:
        await engine.stop()


def main() -> None:
    sampling._at_once = lambda device: True  # the GPU's sampler: the rows at once, drawn by the kernel
    seeded_draw.usable = lambda device: True
    seeded_draw._kernel = lambda: _Launch()
    cuda_graphs.wanted = lambda device, enforce_eager: not enforce_eager
    cuda_graphs.for_model = lambda fast, rows, scratch, prompt_tokens=0: DecodeGraphs(fast, rows, scratch, False)
    with tempfile.TemporaryDirectory() as folder:
        loaded = load_causal_lm(str(build_tiny_model_dir(Path(folder) / "tiny")), dtype="fp32", device="cpu")
        print(
            f"| {STREAMS} sampled rows (temperature 1.0, top_p 0.9) | decode steps "
            "| aten ops a step outside the graph | host waits a step | chained steps |"
        )
        print("|---|---|---|---|---|")
        for in_graph, sampled in ((False, True), (True, True), (True, False)):
            graph_sampling.USE_IN_GRAPHS = in_graph
            steps: list[dict] = []
            launch, step = PersistentBatchRunner.launch_batch, DecodeGraphs._step

            def launch_batch(self: Any, batch: Any, _launch: Any = launch, steps: list[dict] = steps) -> Any:
                count, hazards = _Count(), Hazards()
                with count:
                    out = watch(hazards, _launch, self, batch)
                if batch.num_decode == len(batch.rows) == STREAMS:
                    steps.append({"ops": count.ops, "waits": len(hazards.syncs), "chained": bool(self._chained)})
                return out

            def graph_step(self: Any, size: int, sampled: bool = False, _step: Any = step) -> Any:
                with _disable_current_modes():  # the graph's own step: one replay on a GPU, not counted
                    return _step(self, size, sampled)

            PersistentBatchRunner.launch_batch = launch_batch
            DecodeGraphs._step = graph_step
            try:
                asyncio.run(serve(loaded, sampled))
            finally:
                PersistentBatchRunner.launch_batch, DecodeGraphs._step = launch, step
            steps = steps[2:]  # the first: new requests' bookkeeping
            n = len(steps)
            ops = sum(s["ops"] for s in steps) / n
            waits = sum(s["waits"] for s in steps) / n
            chained = sum(s["chained"] for s in steps)
            name = (
                "after the graph (before)"
                if not in_graph
                else "inside the graph"
                if sampled
                else "greedy rows (for reference)"
            )
            print(f"| {name} | {n} | {ops:.1f} | {waits:.2f} | {chained} of {n} |")


if __name__ == "__main__":
    main()
