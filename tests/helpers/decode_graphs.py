"""Engines built with decode graphs on the test device (engine/attention/cuda_graphs.py): captured on CUDA,
on a CPU the same fixed buffers run without a capture; each step they replay recorded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.attention.cuda_graphs import DecodeGraphs
from lmiserve.engine.runner import graph_sampling

CAPTURE = torch.device(os.environ.get("LMISERVE_TEST_DEVICE", "cpu")).type == "cuda"


@dataclass
class GraphsMade:
    """The decode graphs the engines took (the last: the last engine's) and, for each step they ran, its
    graph size and the number of LoRA adapters in it (0: none); how many steps chained (with adapters)."""

    made: list[DecodeGraphs] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)
    chained: int = 0  # steps whose rows took their inputs from the step before on the device
    chained_lora: int = 0  # those of them with LoRA adapters
    shifted: int = 0  # steps with RoPE shifts (M-RoPE's text: runner/vision_fast.py)
    kinds: set[tuple[int, str]] = field(default_factory=set)  # each step's graph: its size and kind


def graphs_on_the_test_device(monkeypatch: pytest.MonkeyPatch) -> GraphsMade:
    """From now on (in this test) engines built on the fast path take decode graphs unless `enforce_eager`,
    with the Triton attention (in Triton's interpreter on a CPU)."""
    monkeypatch.setenv("LMISERVE_ATTENTION_BACKEND", "triton")
    record = GraphsMade()

    def graphs_here(fast, max_rows: int, scratch_block: int, prompt_tokens: int = 0) -> DecodeGraphs:  # noqa: ANN001
        graphs = DecodeGraphs(fast, max_rows, scratch_block, capture=CAPTURE, prompt_tokens=prompt_tokens)
        original = graphs.run

        def run(ids, positions, tables, lora=None, sources=None, shifts=None):  # noqa: ANN001, ANN202 - DecodeGraphs.run's
            record.steps.append((graphs.size_for(len(ids)), 0 if lora is None else len(lora.adapters)))
            record.chained += sources is not None
            record.chained_lora += sources is not None and lora is not None
            rows = graphs._sampling
            kind = "greedy" if rows is None else graph_sampling.kind(row[0] for row in rows[0])
            record.kinds.add((graphs.size_for(len(ids)), kind))
            record.shifted += shifts is not None and any(shifts)
            return original(ids, positions, tables, lora, sources, shifts)

        graphs.run = run  # type: ignore[method-assign]
        record.made.append(graphs)
        return graphs

    monkeypatch.setattr(cuda_graphs, "wanted", lambda device, enforce_eager: not enforce_eager)
    monkeypatch.setattr(cuda_graphs, "for_model", graphs_here)
    return record
