"""A tensor-parallel rank's shard read from a safetensors checkpoint (engine/model/sharding.py cuts the
model's shell; this fills it): each rank reads only its rows or columns of every split matrix
(safetensors' slices), so no process holds the whole model.

A mixture of experts is read from the checkpoints as published: one matrix per expert
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1``,
``w3``, ``w2``), which transformers merges on load into ``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``
and ``experts.down_proj`` ``[experts, hidden, inter]``; each rank reads its rows (its columns of down) of each
expert's and stacks them so. A checkpoint that stores the merged tensors is read by its slices likewise (gpt-oss's
bf16 checkpoints: ``[experts, in, out]``, gate and up interleaved); gpt-oss's MXFP4 experts (``*_blocks``,
``*_scales``) are read as the rank's outputs of gate/up, or down's whole, and dequantized by transformers; or, on a
GPU where the rank's bf16 part would not fit, kept MXFP4 (`mxfp4_experts.keep_stored`: down's inputs widened to whole
blocks).
Persistent buffers the checkpoint holds (GLM-4.5's router's score biases) are read whole. A quantized checkpoint's
linears (fp8, AWQ, GPTQ) are cut and made by `shard_quantized`; its other fp8 weights (block-wise fp8's, an fp8
expert's) are read as float.

A checkpoint's tensors are found by the names transformers gives them on load (its renamings of the model's
published format: LLaVA's and Gemma 3's ``language_model.model.layers.``, the Qwen VLs' ``model.layers.`` are the
models' ``model.language_model.layers.``). A vision-language model's decoder and output projection are cut as a text
model's; its vision tower and projector are read whole by every rank.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lmiserve.engine.model import expert_codes, fp8_experts, int4_experts, int8_experts, mxfp4_experts
from lmiserve.engine.model.checkpoint_names import renamer
from lmiserve.engine.model.expert_matrices import EXPERT_PARTS, Read, mixtral_name, stacked_experts
from lmiserve.engine.model.quant_formats import QuantSpec, weights_kept_for
from lmiserve.engine.model.shard_quantized import dequantizing_reader, shard_linear
from lmiserve.engine.model.sharding import (
    EXPERT_TENSORS,
    ROW_PARALLEL,
    ShardPlan,
    column_run,
    decoder_of,
    experts_layout,
    experts_part,
    keep_runs,
    padded_vocab,
    row_runs,
    shard_of,
    tied_output,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def checkpoint_files(path: str | Path) -> dict[str, Path] | None:
    """Each tensor of the safetensors checkpoint in `path` and the file it is in (None: no safetensors)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def load_shard_weights(
    model: PreTrainedModel, path: str | Path, quant: QuantSpec | None = None, device: torch.device | None = None
) -> None:
    """Fill the parameters of `model`, cut by `shard_model` while on the meta device (the shell of
    `models.load.load_model_shell`), with its rank's slices read from the safetensors checkpoint in `path`,
    and its persistent buffers the checkpoint holds. A checkpoint quantized as `quant` says: each linear of its
    layers stored fp8 (per channel or tensor), AWQ or GPTQ made the rank's layer of that format on `device` (where
    the model will run: an `Fp8Linear` keeps its tensors out of ``Module.to``), its other fp8 weights read as float.
    ValueError when the checkpoint is not safetensors or lacks a parameter."""
    shard = shard_of(model)
    if shard is None:
        raise ValueError("load_shard_weights fills a model cut by shard_model")
    stored_files = checkpoint_files(path)
    if stored_files is None:
        raise ValueError(f"no safetensors checkpoint in {path}")
    from safetensors import safe_open

    stored = model_names(model, stored_files)
    files = {name: stored_files[at] for name, at in stored.items()}  # by the model's names
    llama = decoder_of(model)  # cut by shard_model, which checked its architecture
    head, embed = llama.lm_head, llama.model.embed_tokens
    tied = tied_output(model)
    if tied:
        head.weight = embed.weight  # one parameter, listed once (as the embedding's)
    split = _split_prefixes(model, llama)
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        layouts = {n: experts_layout(m) for n, m in model.named_modules() if n.endswith(".experts")}

        def slice_of(name: str) -> Any:
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return handles[file].get_slice(stored[name])

        read = dequantizing_reader(slice_of, files, quant)
        made, keep = _quantized_linears(model, files, slice_of, quant, device or torch.device("cpu"), split)
        rank_device, rank = device or torch.device("cpu"), f"rank {shard.plan.rank}"
        if quant is not None and quant.method == "fp8":  # (a mixture of experts' fp8 experts, where kept fp8)
            fp8_experts.keep_stored(model, files, slice_of, quant.blocks, rank_device, rank, shard.plan.part)
        elif quant is not None and quant.method != "mxfp4":  # (4-bit or 8-bit integer ones, where kept)
            codes = int8_experts if quant.bits == 8 else int4_experts
            expert_codes.keep_stored(model, files, slice_of, quant, rank_device, rank, codes, shard.plan.part, keep)
        elif quant is not None and quant.method == "mxfp4" and mxfp4_experts.kept_for(model, rank_device, rank):
            mxfp4_experts.keep_stored(model, files, slice_of, rank_device, shard.plan.part)  # (gpt-oss's experts)
        for name, parameter in model.named_parameters():  # a tied output layer's weight is listed once
            if name.rpartition(".")[0] in made:
                continue
            loaded = _read(name, parameter, files, read, shard.plan, layouts, name.startswith(split))
            if loaded is None:
                raise ValueError(f"the checkpoint in {path} has no tensor {name}")
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, torch.nn.Parameter(loaded, requires_grad=False))
        for name, buffer in list(model.named_buffers()):  # (RoPE's frequencies are computed, not stored)
            if name.rpartition(".")[0] in made:
                continue
            loaded = _read(name, buffer, files, read, shard.plan, layouts, name.startswith(split))
            if loaded is not None:
                owner, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(owner), attribute, loaded)
    if tied:
        head.weight = embed.weight


def model_names(model: PreTrainedModel, files: Mapping[str, Any]) -> dict[str, str]:
    """The checkpoint's tensor names (`files`' keys) by the names `model`'s parameters and buffers have (as
    transformers renames them on load: `checkpoint_names.renamer`), the stored name for each."""
    rename = renamer(model)
    return {rename(name): name for name in files}


def _split_prefixes(model: PreTrainedModel, llama: Any) -> tuple[str, ...]:
    """The name prefixes of what tensor parallelism splits of `model`: everything (a causal LM), a vision-language
    model's decoder and output projection (its vision tower and projector are read whole)."""
    if llama is model:
        return ("",)
    names = {id(module): name for name, module in model.named_modules()}
    return tuple(f"{names[id(m)]}." for m in (llama.model, llama.lm_head))


def _quantized_linears(
    model: PreTrainedModel,
    files: dict[str, Path],
    read: Read,
    quant: QuantSpec | None,
    device: torch.device,
    split: tuple[str, ...] = ("",),
) -> tuple[set[str], bool | None]:
    """Each linear of `model`'s layers that the checkpoint stores quantized (fp8 with a ``weight_scale``, AWQ,
    GPTQ or compressed-tensors' integer codes; block-wise fp8 where the rank keeps it, `weights_kept_for`) replaced
    by the rank's layer of it (`shard_quantized.shard_linear`), and each linear outside `split` (the prefixes of the
    modules tensor parallelism splits, `_split_prefixes`: a VLM's vision tower and projector are not) by the whole
    layer; their names, and `weights_kept_for`'s decision (None where not asked)."""
    if quant is None or quant.method not in ("fp8", "awq", "gptq", "int8"):
        return set(), None
    key = quant.codes_key
    plan = cast(Any, shard_of(model)).plan
    keep = weights_kept_for(model, device, f"rank {plan.rank}", quant.kernel_family, quant.blocks is not None)
    if quant.blocks and not keep:
        return set(), keep  # block-wise fp8 de-quantized at load: read as float (`dequantizing_reader`)
    made = set()
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or f"{name}.{key}" not in files:
            continue
        whole = not f"{name}.".startswith(split)
        if not whole and ".layers." not in name:
            continue
        layer = shard_linear(name, files, read, None if whole else plan, quant, module.weight.dtype, device, keep)
        if layer is None:
            continue
        shape, rank_shape = (getattr(layer, "out_features", -1), getattr(layer, "in_features", -1)), module.weight.shape
        if list(shape) != list(rank_shape):  # (out, in), as a weight's shape
            raise ValueError(f"{name}: the checkpoint's shard is {list(shape)}, the rank's linear {list(rank_shape)}")
        cast(Any, layer).lora_shape = (module.in_features, module.out_features)  # the whole linear's: adapters fit it
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, layer)
        made.add(name)
    return made, keep


def _read(
    name: str,
    like: torch.Tensor,
    files: dict[str, Path],
    read: Read,
    plan: ShardPlan,
    layouts: dict[str, Any],
    split: bool = True,
) -> torch.Tensor | None:
    """This rank's part of `name` as the checkpoint stores it (None: it does not), in `like`'s dtype and shape;
    `layouts`: each experts module's (`experts_layout`), by name; not `split`: the whole tensor (a vision tower's)."""
    owner, _, kind = name.rpartition(".")
    stored = name if name in files else mixtral_name(name)
    loaded: torch.Tensor | None = None
    if not split:
        loaded = torch.as_tensor(read(name)[:]) if name in files else None
    elif owner in layouts and kind in EXPERT_TENSORS:
        if stored in files:
            loaded = experts_part(read(stored), kind, plan, *layouts[owner])
        elif f"{name}_blocks" in files:  # gpt-oss's MXFP4
            loaded = _mxfp4(name, kind, read, plan, like.dtype)
        elif kind in EXPERT_PARTS:
            loaded = stacked_experts(owner, kind, int(like.shape[0]), files, read, plan.part)
    elif stored in files:
        loaded = _slice(read(stored), name, plan)
    if loaded is None:
        return None
    loaded = loaded.to(like.dtype)
    if tuple(loaded.shape) != tuple(like.shape):
        raise ValueError(f"{name}: the checkpoint's slice is {tuple(loaded.shape)}, not {tuple(like.shape)}")
    return loaded


def _mxfp4(name: str, kind: str, read: Read, plan: ShardPlan, dtype: torch.dtype) -> torch.Tensor | None:
    """The rank's part of gpt-oss's MXFP4 experts tensor `name` (its ``_blocks`` ``[experts, out, in / 32, 16]`` and
    ``_scales``), dequantized to `dtype` by transformers as ``[experts, in, out]``: gate/up's outputs of the rank
    (whole gate and up pairs: one run) read alone; down's inputs cut after the whole is dequantized (a rank's
    part of the intermediate size need not be whole blocks of 32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if kind not in ("gate_up_proj", "down_proj"):
        return None
    blocks, scales = read(f"{name}_blocks"), read(f"{name}_scales")
    if kind == "gate_up_proj":
        part = plan.part(blocks.get_shape()[1])
        return convert_moe_packed_tensors(
            torch.as_tensor(blocks[:, part]), torch.as_tensor(scales[:, part]), dtype=dtype
        )
    whole = convert_moe_packed_tensors(torch.as_tensor(blocks[:]), torch.as_tensor(scales[:]), dtype=dtype)
    return experts_part(whole, "down_proj", plan, True, False).contiguous()


def _slice(tensor: Any, name: str, plan: ShardPlan) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (a safetensors slice: only that part is read): a
    column-parallel linear's rows (`row_runs`), a row-parallel one's input columns (`column_run`; its bias whole,
    which rank 0 alone keeps), gpt-oss's sinks of the rank's heads, the vocabulary's rows; the rest (the norms, a
    router) whole."""
    owner, _, kind = name.rpartition(".")
    module = owner.rpartition(".")[2]
    shape = tensor.get_shape()
    if kind == "sinks":
        return torch.as_tensor(tensor[plan.heads()])
    runs = row_runs(plan, module, shape[0])
    if runs is not None:
        return keep_runs(tensor, runs)
    if module in ROW_PARALLEL and kind == "weight":
        return torch.as_tensor(tensor[:, column_run(plan, module, shape[1])])
    if module in ("embed_tokens", "lm_head"):
        return padded_vocab(
            torch.as_tensor(tensor[plan.vocab_first : min(plan.vocab_first + plan.vocab_part, plan.vocab)]), plan
        )
    return torch.as_tensor(tensor[:])
