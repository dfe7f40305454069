"""A model's tensor-parallel ranks without a process group: cut from the model (`cut`), or read from a checkpoint
into meta shells as each rank's process reads it (`shell_of`, `read_ranks`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from lmiserve.engine.model.shard_checkpoint import load_shard_weights
from lmiserve.engine.model.sharding import shard_model


def cut(model: Any, world: int) -> list[Any]:
    """`world` copies of `model`, each cut to its rank's shard (no process group)."""
    shards = [copy.deepcopy(model) for _ in range(world)]
    for rank, shard in enumerate(shards):
        shard_model(shard, rank, world, None)
    return shards


def shell_of(model: Any) -> Any:
    """`model`'s architecture with its parameters on the meta device, its buffers real (`load_model_shell`'s)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return type(model)(copy.deepcopy(model.config)).eval()


def read_ranks(model: Any, path: Path, world: int = 2, quant: Any = None) -> list[Any]:
    """Each of `world` ranks of `model`'s architecture read from the checkpoint in `path` (`quant`: its
    `QuantSpec`) on the CPU, as `load_shard_weights` reads a rank's slices."""
    ranks = []
    for rank in range(world):
        shell = shell_of(model)
        shard_model(shell, rank, world, None)
        load_shard_weights(shell, path, quant, torch.device("cpu"))
        ranks.append(shell)
    return ranks
