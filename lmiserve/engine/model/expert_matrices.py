"""A mixture of experts' matrices as checkpoints publish them: one matrix per expert
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1``,
``w3``, ``w2``), which transformers merges on load into ``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]`` and
``experts.down_proj`` ``[experts, hidden, inter]``. `stacked_experts` stacks them so, whole or a tensor-parallel rank's
part, for the loaders (`shard_checkpoint`, `models.quantized_load`) and for fp8 experts kept fp8 (`fp8_experts`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["EXPERT_PARTS", "Read", "WholeBlocks", "mixtral_name", "stacked_experts"]

# the names of each expert's matrices that make a merged experts tensor: Qwen's, GLM's, OLMoE's; Mixtral's
EXPERT_PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
Read = Callable[[str], Any]  # a checkpoint tensor's safetensors slice, by its name


def mixtral_name(name: str) -> str:
    """Mixtral's checkpoint name of a tensor of its MoE block (transformers names the block ``mlp``)."""
    return name.replace(".mlp.", ".block_sparse_moe.", 1)


def stacked_experts(
    owner: str,
    kind: str,
    count: int,
    names: Mapping[str, Any],
    read: Read,
    part: Callable[[int], slice],
    inputs: Callable[[int], slice] | None = None,
) -> Any:
    """Merged experts tensor ``owner.kind`` (``gate_up_proj`` ``[experts, 2 * inter, hidden]``, ``down_proj``
    ``[experts, hidden, inter]``) stacked from the checkpoint's matrices of each of the `count` experts (`names`: the
    checkpoint's tensors), each cut to `part` of its intermediate size (a rank's, `ShardPlan.part`; or all of it;
    down_proj's inputs to `inputs` where given: `WholeBlocks`); None when the checkpoint has them under none of the
    names `EXPERT_PARTS` knows."""
    for prefix in (owner, mixtral_name(owner)):
        for parts in EXPERT_PARTS[kind]:
            first = f"{prefix}.0.{parts[0]}"
            if not any(f"{first}.{key}" in names for key in ("weight", "weight_packed", "qweight")):
                continue  # (integer codes: `read` de-quantizes them, `dequantizing_reader`)
            pieces = []
            for name in parts:  # gate's rows of every expert, then up's: as ``gate_up_proj`` holds them
                each = [read(f"{prefix}.{e}.{name}.weight") for e in range(count)]
                if kind == "down_proj":
                    run = inputs or part
                    pieces.append(torch.stack([torch.as_tensor(t[:, run(t.get_shape()[1])]) for t in each]))
                else:
                    pieces.append(torch.stack([torch.as_tensor(t[part(t.get_shape()[0])]) for t in each]))
            return torch.cat(pieces, dim=1)
    return None


class WholeBlocks:
    """A tensor-parallel rank's part (`part`) of down_proj's inputs widened to whole blocks of `block` inputs (0: as
    `part` says), as kept experts read them (`stacked_experts`' `inputs`), and the zero inputs the rank's activations
    are padded with before and after (`pad`, the last call's: `grouped_experts.keep`'s `down_pad`). A quantized
    checkpoint's scales cover blocks of inputs (MXFP4's 32, fp8's 128, GPTQ's and AWQ's groups), and a rank's part
    need not be whole blocks: gpt-oss-120b's 2880 over four ranks is 720 each, 22.5 blocks of 32; Qwen3-235B-A22B's
    1536 over eight is 192, 1.5 blocks of 128. The inputs the rank's weights then hold beyond its own (its
    neighbours') multiply zeros, so the ranks' outputs still sum to the whole."""

    def __init__(self, part: Callable[[int], slice], block: int) -> None:
        self.part, self.block, self.pad = part, block, (0, 0)

    def __call__(self, size: int) -> slice:
        run = self.part(size)
        if not self.block:
            return run
        first, end = run.start // self.block * self.block, min(size, -(-run.stop // self.block) * self.block)
        self.pad = (run.start - first, end - run.stop)
        return slice(first, end)
