"""Decode graphs in tensor-parallel workers on a CPU (engine/attention/cuda_graphs.py): the workers are spawned
processes, which a test's monkeypatch does not reach, so a `WorkerSpec` is given `load_shell_with_graphs` as its
`load_shell`: in the worker, before its shard is loaded, it makes runners take decode graphs (unless
`enforce_eager`) whose fixed buffers run without a capture on a CPU, with the Triton attention under Triton's
interpreter (as helpers/decode_graphs.py does in the test's own process), and writes each step a graph runs to the
file `GRAPH_LOG` names, one line ``<pid> <graph size> <chained>`` a step (chained: 1 where the step's rows took
their inputs from the step before on the device, overlap scheduling's chain)."""

from __future__ import annotations

import os
from typing import Any

from lmiserve.models.load import load_model_shell

GRAPH_LOG = "LMISERVE_TEST_GRAPH_STEPS"  # the environment variable naming the file


def load_shell_with_graphs(path: str, *, dtype: str, device: str, trust_remote_code: bool) -> Any:
    """`load_model_shell`, once decode graphs are on in this process (a worker's)."""
    _graphs_without_capture(os.environ[GRAPH_LOG])
    return load_model_shell(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def _graphs_without_capture(log: str) -> None:
    from lmiserve.engine.attention import cuda_graphs
    from lmiserve.engine.attention.cuda_graphs import DecodeGraphs

    os.environ["LMISERVE_ATTENTION_BACKEND"] = "triton"

    def for_model(fast: Any, max_rows: int, scratch_block: int, prompt_tokens: int = 0) -> DecodeGraphs:
        graphs = DecodeGraphs(fast, max_rows, scratch_block, capture=False, prompt_tokens=prompt_tokens)
        run = graphs.run

        def counted(ids: Any, positions: Any, tables: Any, lora: Any = None, sources: Any = None, *rest: Any) -> Any:
            with open(log, "a", encoding="utf-8") as out:
                out.write(f"{os.getpid()} {graphs.size_for(len(ids))} {int(sources is not None)}\n")
            return run(ids, positions, tables, lora, sources, *rest)

        graphs.run = counted  # type: ignore[method-assign]
        return graphs

    cuda_graphs.wanted = lambda device, enforce_eager: not enforce_eager  # type: ignore[assignment]
    cuda_graphs.for_model = for_model  # type: ignore[assignment]
