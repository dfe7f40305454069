"""A vision-language model's shard (engine/model/sharding.py, engine/model/shard_checkpoint.py): its decoder and output
projection cut as a text model's, its vision tower and projector whole; read from the checkpoint as published
(transformers' renamings of LLaVA's, Gemma 3's and the Qwen VLs' names), a rank's shard is the shard cut from the
whole model. Served over two ranks: tests/integration/test_tensor_parallel_vlm_engine.py."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.tiny_vlm import FAMILIES, MOE_FAMILIES
from lmiserve.engine.model.language_model import language_model
from lmiserve.engine.model.shard_checkpoint import checkpoint_files, load_shard_weights, model_names
from lmiserve.engine.model.sharding import decoder_of, shard_model, shard_of, unsplittable_reason
from lmiserve.models.load import load_causal_lm, load_model_shell


def _read_and_cut(path, whole, rank: int):  # noqa: ANN001, ANN202
    """Rank `rank` of 2's shard of the VLM in `path` read from its checkpoint into a shell, and cut from `whole`."""
    cut = copy.deepcopy(whole)
    shard_model(cut, rank, 2, None)
    shell = load_model_shell(path, dtype="fp32", device="cpu").model
    shard_model(shell, rank, 2, None)
    load_shard_weights(shell, path)
    return shell, cut


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_a_vlms_shard_read_from_its_checkpoint_is_the_shard_cut_from_the_model(tiny_vlm_dir, family):
    path = tiny_vlm_dir(family)
    whole = load_causal_lm(path, dtype="fp32", device="cpu").model
    decoder = language_model(whole)
    assert decoder is not None
    split = {id(p) for m in (decoder.model, decoder.lm_head) for p in m.parameters()}
    kept_whole = {name for name, p in whole.named_parameters() if id(p) not in split}
    assert any("vision" in name or "visual" in name for name in kept_whole), family
    for rank in range(2):
        shell, cut = _read_and_cut(path, whole, rank)
        read, expected = dict(shell.named_parameters()), dict(cut.named_parameters())
        assert read.keys() == expected.keys()
        for name, param in expected.items():
            assert torch.equal(read[name], param), (family, rank, name)
        originals = dict(whole.named_parameters())
        for name in kept_whole:  # every rank holds the vision tower and the projector whole
            assert torch.equal(read[name], originals[name]), (family, name)
        view = decoder_of(shell)
        assert shard_of(view) is shard_of(shell) is not None
        assert view.config.num_attention_heads == whole.config.get_text_config().num_attention_heads // 2
        assert view.model.embed_tokens.weight.shape[0] == -(-whole.config.get_text_config().vocab_size // 2)
        assert str(view.device) == "cpu"  # (the view follows its model off the meta device)


def test_the_checkpoints_names_are_found_as_transformers_renames_them(tiny_vlm_dir):
    """LLaVA's checkpoint keeps its decoder under ``language_model.model.`` and its head as ``language_model.lm_head``;
    the Qwen VLs' under ``model.`` with the vision tower as ``visual.``: each is found by the model's own name."""
    for family, stored, named in [
        ("llava", "language_model.model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight"),
        ("llava", "language_model.lm_head.weight", "lm_head.weight"),
        ("llava", "vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.weight"),
        ("qwen2_5_vl", "model.layers.1.mlp.down_proj.weight", "model.language_model.layers.1.mlp.down_proj.weight"),
        ("qwen2_5_vl", "visual.blocks.0.mlp.down_proj.weight", "model.visual.blocks.0.mlp.down_proj.weight"),
        ("qwen3_vl", "model.language_model.norm.weight", "model.language_model.norm.weight"),
    ]:  # fmt: skip
        path = tiny_vlm_dir(family)
        files = checkpoint_files(path)
        assert files is not None and stored in files
        names = model_names(load_model_shell(path, device="cpu").model, files)
        assert names[named] == stored, (family, named)


def test_a_text_models_names_are_its_checkpoints(tiny_model_dir):
    files = checkpoint_files(tiny_model_dir)
    assert files is not None
    names = model_names(load_model_shell(tiny_model_dir, device="cpu").model, files)
    assert names == {name: name for name in files}


def test_which_vlms_split_and_why_not(tiny_vlm_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_vlm_dir("qwen2_5_vl"))
    assert unsplittable_reason(config, 2) is None
    assert unsplittable_reason(config, 3) == "tensor_parallel_degree=3 does not divide the model's 4 attention heads"
    olmo = copy.deepcopy(AutoConfig.from_pretrained(tiny_vlm_dir("llava")))
    olmo.text_config.model_type = "gpt2"  # (a decoder lmiserve's forward does not run)
    assert (
        unsplittable_reason(olmo, 2)
        == "tensor parallelism splits VLMs whose decoder lmiserve runs; 'llava''s is 'gpt2'"
    )


def test_a_tied_vlms_shard_keeps_its_output_projection_its_embedding(tiny_vlm_dir, tmp_path):
    """Gemma 3 as published ties its output projection to its embedding (the tiny one does not): each rank's head is
    its vocabulary rows of the embedding, as the whole model's cut."""
    import json
    import shutil

    path = tmp_path / "gemma3-tied"
    shutil.copytree(tiny_vlm_dir("gemma3"), path)
    saved = json.loads((path / "config.json").read_text())
    saved["tie_word_embeddings"] = saved["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(saved))
    whole = load_causal_lm(path, dtype="fp32", device="cpu").model
    for rank in range(2):
        shell, cut = _read_and_cut(path, whole, rank)
        view = decoder_of(shell)
        assert view.lm_head.weight is view.model.embed_tokens.weight
        expected = dict(cut.named_parameters())
        assert all(torch.equal(p, expected[n]) for n, p in shell.named_parameters())
