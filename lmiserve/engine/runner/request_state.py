"""What a runner keeps of one request between steps: the persistent batch's row (runner/persistent_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.core.request import SamplingParams
from lmiserve.engine.runner.graph_sampling import in_graph
from lmiserve.engine.runner.penalties import penalized
from lmiserve.engine.runner.sampling import needs_processing, plain_greedy

if TYPE_CHECKING:
    from lmiserve.engine.lora.adapters import LoraAdapter

__all__ = ["RequestState"]


@dataclass
class RequestState:
    """What the runner keeps of one request between steps (the persistent batch's row)."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # only ever extended, or replaced (the graphs rely on it)
    generator: torch.Generator | None = None
    adapter: LoraAdapter | None = None
    images: Any = None  # a VLM prompt's image features, kept across preemptions (runner/vision.py)
    penalty_slot: int | None = None  # its slot in the runner's `PenaltyBook` (runner/penalties.py), once penalized
    banned: list[int] = field(default_factory=list)  # the ids its `min_new_tokens` bans (`sampling.banned_ids`)
    argmax: bool = field(init=False)  # greedy without processing: its token is its row's argmax (a top-N aside)
    plain: bool = field(init=False)  # `plain_greedy(params)`: the argmax alone, no top-N
    in_graph: bool = field(init=False)  # `graph_sampling.in_graph(params, banned)`: a decode graph may sample it
    penalized: bool = field(init=False)  # `penalties.penalized(params)`: its rows are penalized from the book

    def __post_init__(self) -> None:
        self.argmax, self.plain = not needs_processing(self.params), plain_greedy(self.params)
        self.in_graph, self.penalized = in_graph(self.params, len(self.banned)), penalized(self.params)
