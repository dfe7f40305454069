"""Tensor-parallel ranks as real processes over a gloo group on the CPU: a rank's function runs in each (`run_ranks`),
with its collectives, and returns what it made through a file. For the loading steps that reduce over the ranks
(``quantize=fp8``'s row maxima), where the ranks without a process group (`rank_shards`) cannot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def run_ranks(world: int, work: Callable[..., Any], folder: Path, *args: Any) -> list[Any]:
    """`work(rank, *args)` in `world` spawned processes joined in a gloo group (its files in `folder`); each rank's
    result, by rank. `work` must be importable (a module's function): the processes are spawned."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, work, folder, args), nprocs=world, join=True)
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _rank(rank: int, world: int, work: Callable[..., Any], folder: Path, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder / 'group'}", rank=rank, world_size=world)
    try:
        torch.save(work(rank, *args), folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def fp8_experts_at_load(rank: int, arch: str, kept: list[bool]) -> list[dict[str, torch.Tensor]]:
    """Rank `rank` of two cuts the MoE model of `llama_variants.MOE_ARCHS[arch]` (`build`'s seeded weights) and makes
    its experts as ``quantize=fp8`` over tensor parallelism does (`fp8_experts.quantize_servable` with the ranks'
    maxima), its `kept_for` saying `kept[rank]`: each layer's experts' matrices (de-quantized where kept: the fp8
    values times their scales), and whether they were kept."""
    import torch.distributed as dist

    from helpers.llama_variants import MOE_ARCHS, build
    from lmiserve.engine.model import fp8_experts, grouped_experts
    from lmiserve.engine.model.shard_quantized import maxima_over_ranks
    from lmiserve.engine.model.sharding import shard_model

    model = build(*MOE_ARCHS[arch])
    shard_model(model, rank, dist.get_world_size(), dist.group.WORLD)
    fp8_experts.kept_for = lambda model, device, name: kept[rank]  # (a rank's GPU with room, or not)
    fp8_experts.INTERPRETED_ON_CPU = True  # (kept as on a GPU; the CPU's q8 kernel's ranks: test_cpu_experts.py)
    count = fp8_experts.quantize_servable(model, torch.device("cpu"), f"rank {rank}", maxima_over_ranks(model))
    made = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        matrices = {"kept": torch.tensor(grouped_experts.kept(experts)), "count": torch.tensor(count)}
        for kind in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, kind).detach()
            if grouped_experts.kept(experts):
                weight = weight.float() * getattr(experts, f"{kind}_scales")[..., None]
            matrices[kind] = weight
        made.append(matrices)
    return made
