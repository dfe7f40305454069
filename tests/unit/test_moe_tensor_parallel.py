"""Tensor parallelism of a mixture of experts without processes (engine/model/sharding.py): every expert split
on its intermediate size (gate/up rows, down columns), a shared expert as a dense MLP, the router whole on every
rank, so the ranks' MoE blocks are partial sums of the whole block's output; each rank's shard read from the
checkpoint as published (one matrix per expert; Mixtral's names) or with the experts merged, GLM-4.5's router
biases (a buffer) read with it; OLMoE refused; adapters on a mixture of experts' MLPs refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from helpers.llama_variants import MOE_ARCHS, build
from helpers.rank_shards import cut, shell_of
from lmiserve.engine.model.layout_variants import moe_block, moe_forward
from lmiserve.engine.model.shard_checkpoint import load_shard_weights
from lmiserve.engine.model.sharding import experts_layout, shard_model, unsplittable_reason

SPLIT = ["mixtral", "qwen2_moe_shared", "qwen3_moe", "glm4_moe", "gpt_oss"]


@pytest.mark.parametrize("arch", SPLIT)
@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_moe_blocks_sum_to_the_whole_block(arch, world):
    """Each rank routes every token as the whole model (its router whole), runs each expert on its part of the
    intermediate size: the ranks' outputs (what the all-reduce adds) are the whole block's, shared expert and its
    gate included; each rank keeps 1/world of every expert."""
    model = build(*MOE_ARCHS[arch])
    shards = cut(model, world)
    torch.manual_seed(1)
    x = torch.randn(7, model.config.hidden_size)
    checked = 0
    with torch.inference_mode():
        for i, layer in enumerate(model.model.layers):
            block = moe_block(layer)
            if block is None:  # (a dense layer: split as a dense model's, tests/unit/test_tensor_parallel.py)
                continue
            parts = [moe_block(shard.model.layers[i]) for shard in shards]
            whole = block.experts
            transposed = experts_layout(whole)[0]  # (gpt-oss's [experts, in, out])
            inter = whole.down_proj.shape[1 if transposed else 2]
            for experts in (p.experts for p in parts):
                hidden, experts_count = model.config.hidden_size, whole.gate_up_proj.shape[0]
                mine = (experts_count, hidden, 2 * inter // world) if transposed else (
                    experts_count, 2 * inter // world, hidden)  # fmt: skip
                assert experts.gate_up_proj.shape == mine
                assert experts.down_proj.shape[1 if transposed else 2] == inter // world
            router = "router" if hasattr(block, "router") else "gate"  # the router: whole on every rank
            assert torch.equal(getattr(parts[0], router).weight, getattr(block, router).weight)
            total = sum(moe_forward(part, x) for part in parts)
            torch.testing.assert_close(total, moe_forward(block, x), rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 1


def test_gate_up_keeps_each_experts_gate_and_up_runs():
    """A rank's ``gate_up_proj`` holds its rows of every expert's gate, then its rows of its up (as the experts'
    ``chunk(2)`` reads them), and its columns of ``down_proj``."""
    model = build(*MOE_ARCHS["qwen3_moe"])
    whole = moe_block(model.model.layers[0]).experts
    gate_up, down = whole.gate_up_proj.detach(), whole.down_proj.detach()
    inter = down.shape[2]
    for rank, shard in enumerate(cut(model, 2)):
        experts = moe_block(shard.model.layers[0]).experts
        mine = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(experts.gate_up_proj[:, : inter // 2], gate_up[:, :inter][:, mine])
        assert torch.equal(experts.gate_up_proj[:, inter // 2 :], gate_up[:, inter:][:, mine])
        assert torch.equal(experts.down_proj, down[:, :, mine])
        assert not experts.gate_up_proj.requires_grad


def _merged_checkpoint(model, folder: Path) -> None:
    """`model` saved with its experts merged as transformers holds them (``experts.gate_up_proj``), in two files."""
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if "inv_freq" not in k}
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, half in enumerate(halves):
        file = f"model-{i}.safetensors"
        save_file({k: state[k] for k in half}, folder / file)
        weight_map.update(dict.fromkeys(half, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("arch", SPLIT)
@pytest.mark.parametrize("layout", ["published", "merged"])
def test_a_shard_read_from_the_checkpoint_is_the_shard_cut_from_the_model(tmp_path, arch, layout):
    """Each rank reads its rows of each expert's matrices (Mixtral's under ``block_sparse_moe``, ``w1``/``w3``/
    ``w2``) or of the merged tensors, and ends with what a rank that loaded the whole model and cut it holds:
    every parameter, and GLM-4.5's router biases (a buffer of the checkpoint, not zeros)."""
    model = build(*MOE_ARCHS[arch])
    folder = tmp_path / "model"
    if layout == "published":
        model.save_pretrained(folder, max_shard_size="100KB")
        assert (folder / "model.safetensors.index.json").is_file()
    else:
        _merged_checkpoint(model, folder)
    for rank, expected in enumerate(cut(model, 2)):
        shell = shell_of(model)
        shard_model(shell, rank, 2, None)
        load_shard_weights(shell, folder)
        read, cut_params = dict(shell.named_parameters()), dict(expected.named_parameters())
        assert read.keys() == cut_params.keys()
        for name, param in cut_params.items():
            assert torch.equal(read[name], param), (rank, name)
        buffers = dict(expected.named_buffers())
        for name, buffer in shell.named_buffers():
            assert torch.equal(buffer, buffers[name]), (rank, name)
    if arch == "glm4_moe":
        bias = dict(shell.named_buffers())["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.abs().sum() > 0


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build(*MOE_ARCHS["qwen3_moe"])
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    shell = shell_of(model)
    shard_model(shell, 0, 2, None)
    with pytest.raises(ValueError, match=r"has no tensor model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        load_shard_weights(shell, tmp_path)


@pytest.mark.parametrize(
    ("arch", "overrides", "world", "reason"),
    [
        ("qwen3_moe", {}, 2, None),
        ("qwen2_moe_shared", {}, 4, None),
        ("qwen3_moe", {"moe_intermediate_size": 50}, 4,
         "tensor_parallel_degree=4 does not divide the model's experts' intermediate size 50"),
        ("qwen2_moe_shared", {"shared_expert_intermediate_size": 90}, 4,
         "tensor_parallel_degree=4 does not divide the model's shared expert's intermediate size 90"),
    ],
)  # fmt: skip
def test_the_experts_intermediate_sizes_must_split(arch, overrides, world, reason):
    config = copy.deepcopy(build(*MOE_ARCHS[arch]).config)
    for key, value in overrides.items():
        setattr(config, key, value)
    assert unsplittable_reason(config, world) == reason


def test_olmoe_splits():
    """OLMoE's norms of the whole q and k projections split with its heads (each rank's part, the mean of the
    squares all-reduced: tests/integration/test_tensor_parallel_engine.py), its experts as the others'."""
    assert unsplittable_reason(build(*MOE_ARCHS["olmoe"]).config, 2) is None


def test_adapters_on_a_mixture_of_experts_over_tensor_parallelism_adapt_attention_alone(tmp_path, tiny_model):
    """Over tensor parallelism lmiserve's forward serves a mixture of experts' adapters on attention; one on its
    MLPs (a shared expert's, a dense layer's) is refused when it is loaded, never silently dropped."""
    from peft import LoraConfig, get_peft_model

    from lmiserve.config import Settings
    from lmiserve.engine.lora.adapters import AdapterError
    from lmiserve.models.compose import build_tensor_parallel_engine
    from lmiserve.models.load import load_model_shell

    folder = tmp_path / "qwen2_moe"
    model = build(*MOE_ARCHS["qwen2_moe_shared"])
    model.save_pretrained(folder)
    tiny_model.tokenizer.save_pretrained(folder)
    options = {"model_id": str(folder), "device": "cpu", "tensor_parallel_degree": "2", "enable_lora": "true"}
    engine = build_tensor_parallel_engine(load_model_shell(folder, device="cpu"), Settings.from_options(options), 2)
    registry = engine.adapters
    assert registry is not None
    for name, targets in (("attention", ["q_proj", "v_proj"]), ("mlp", ["q_proj", "gate_proj"])):
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=targets))
        peft_model.save_pretrained(tmp_path / name)
    registry.register("attention", tmp_path / "attention")
    with pytest.raises(AdapterError, match="adapter mlp targets gate_proj; adapters on this model may target q_proj"):
        registry.register("mlp", tmp_path / "mlp")


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_its_part_of_gpt_oss_mxfp4_experts(tmp_path, world):
    """From gpt-oss's MXFP4 checkpoint (the shell as a tensor-parallel leader loads it: float experts, no quantizer)
    each rank reads its outputs of gate/up's blocks and down's whole (at 4 ranks a rank's 16 inputs of down are half
    a block of 32), dequantized: the shard cut from the float model the checkpoint encodes exactly."""
    from helpers.mxfp4 import write_mxfp4_gpt_oss
    from lmiserve.models.load import load_model_shell

    state = write_mxfp4_gpt_oss(tmp_path)
    for rank in range(world):
        shell = load_model_shell(tmp_path, dtype="fp32", device="cpu").model
        whole = copy.deepcopy(shell)
        whole.load_state_dict(state, assign=True)
        shard_model(whole, rank, world, None)
        shard_model(shell, rank, world, None)
        load_shard_weights(shell, tmp_path)
        expected = dict(whole.named_parameters())
        for name, param in shell.named_parameters():
            assert not param.is_meta and torch.equal(param, expected[name]), (rank, name)
