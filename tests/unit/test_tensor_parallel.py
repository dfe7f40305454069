"""Tensor parallelism without processes (issue #25): which degrees a model splits over
(`unsplittable_reason`), the share each rank keeps (`shard_plan`), the weights `shard_model` leaves on
each rank (two ranks cut in one process, no torch.distributed: the ranks' pieces put back together give
the whole model's weights and products), and the settings that turn it on or refuse it."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from helpers.rank_shards import cut, shell_of
from lmiserve.config import Settings
from lmiserve.config.errors import ConfigError
from lmiserve.config.sources import load_settings
from lmiserve.engine.model.shard_checkpoint import checkpoint_files, load_shard_weights
from lmiserve.engine.model.sharding import (
    ShardPlan,
    shard_model,
    shard_of,
    shard_plan,
    unsplittable_reason,
)


def config(**overrides):
    """A Llama config's shape as `unsplittable_reason` and `shard_plan` read it."""
    values = {
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 509,
    }
    return SimpleNamespace(**{**values, **overrides})


# ---- shard_plan ------------------------------------------------------------------------------------------


def test_split_kv_heads_and_uneven_vocabulary():
    """4 heads, 2 KV heads over 2 ranks: 2 query heads and 1 KV head each; 509 tokens in parts of 255
    (the last rank's part runs one row past the vocabulary)."""
    plans = [shard_plan(config(), rank, 2) for rank in range(2)]
    assert plans == [
        ShardPlan(0, 2, 16, q_first=0, q_heads=2, kv_first=0, kv_heads=1, kv_total=2, vocab=509, vocab_first=0,
                  vocab_part=255),
        ShardPlan(1, 2, 16, q_first=2, q_heads=2, kv_first=1, kv_heads=1, kv_total=2, vocab=509, vocab_first=255,
                  vocab_part=255),
    ]  # fmt: skip
    assert [plan.part(128) for plan in plans] == [slice(0, 64), slice(64, 128)]  # an intermediate size's halves
    assert plans[-1].vocab_first + plans[-1].vocab_part - plans[-1].vocab == 1  # one padded row


def test_replicated_kv_heads_follow_their_query_heads():
    """Fewer KV heads than ranks: each rank keeps the one KV head its query heads read (8 heads, 2 KV
    heads: heads 0-3 read KV head 0, 4-7 KV head 1; over 4 ranks of 2 heads each)."""
    cfg = config(num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    plans = [shard_plan(cfg, rank, 4) for rank in range(4)]
    assert [(p.q_first, p.q_heads) for p in plans] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(p.kv_first, p.kv_heads) for p in plans] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    one_kv = [shard_plan(config(num_key_value_heads=1), rank, 2) for rank in range(2)]
    assert [(p.kv_first, p.kv_heads) for p in one_kv] == [(0, 1), (0, 1)]
    # 8 heads, 1 KV head, 8 ranks: every rank has one query head and the only KV head
    cfg = config(num_attention_heads=8, num_key_value_heads=1, hidden_size=128, intermediate_size=256)
    assert {(shard_plan(cfg, rank, 8).kv_first, shard_plan(cfg, rank, 8).kv_heads) for rank in range(8)} == {(0, 1)}


def test_vocabulary_parts_cover_it_once_and_pad_only_the_end():
    for vocab, world in [(509, 2), (512, 2), (509, 4), (49152, 3), (7, 4)]:
        cfg = config(vocab_size=vocab, num_attention_heads=12, num_key_value_heads=12, intermediate_size=12 * 8)
        plans = [shard_plan(cfg, rank, world) for rank in range(world)]
        part = plans[0].vocab_part
        assert part == -(-vocab // world)
        assert [p.vocab_first for p in plans] == [rank * part for rank in range(world)]
        assert world * part - vocab < world  # under one row a rank of padding


def test_head_dim_from_the_config_wins_over_hidden_over_heads():
    plan = shard_plan(config(head_dim=32), 1, 2)
    assert (plan.head_dim, plan.q_first, plan.q_heads) == (32, 2, 2)


def test_no_kv_heads_in_the_config_means_one_per_head():
    cfg = config()
    del cfg.num_key_value_heads
    assert [(p.kv_first, p.kv_heads) for p in (shard_plan(cfg, r, 2) for r in range(2))] == [(0, 2), (2, 2)]


# ---- unsplittable_reason -----------------------------------------------------------------------------------


UNSPLIT = (
    "tensor parallelism runs the fast path's architectures (llama, mistral, ministral, qwen2, qwen3, phi3, smollm3, "
    "granite, seed_oss, gemma, gemma3_text, olmo2, olmo3, exaone4, starcoder2, glm, glm4, gemma2, mixtral, qwen2_moe, "
    "qwen3_moe, glm4_moe, olmoe, gpt_oss)"
)


@pytest.mark.parametrize(
    ("overrides", "world", "reason"),
    [
        ({}, 2, None),
        ({}, 4, None),  # 2 KV heads replicated over 4 ranks
        ({"num_key_value_heads": 1}, 4, None),
        ({"model_type": "gpt2"}, 2, f"{UNSPLIT}; this model is 'gpt2'"),
        ({"model_type": "olmo2"}, 2, None),  # its norms of the whole q and k: each rank its heads' part
        ({"model_type": "olmoe"}, 2, None),  # OLMo 2's norms, with experts
        ({"model_type": "qwen3_moe", "moe_intermediate_size": 48}, 2, None),  # its experts split as its MLP
        ({}, 3, "tensor_parallel_degree=3 does not divide the model's 4 attention heads"),
        ({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536}, 2,
         "tensor_parallel_degree=2 does not divide the model's 9 attention heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2,
         "tensor_parallel_degree=2 neither divides the model's 3 KV heads nor is a multiple of them"),
        ({"intermediate_size": 130}, 4, "tensor_parallel_degree=4 does not divide the model's intermediate size 130"),
        ({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536}, 3,
         None),  # SmolLM2-135M's shape
    ],
)  # fmt: skip
def test_unsplittable_reason_is_one_line_or_none(overrides, world, reason):
    cfg = config(**overrides)
    assert unsplittable_reason(cfg, world) == reason
    if reason is None:
        shard_plan(cfg, world - 1, world)
    else:
        assert "\n" not in reason
        with pytest.raises(ValueError, match="^" + reason.replace("(", r"\(").replace(")", r"\)") + "$"):
            shard_plan(cfg, 0, world)


def test_a_degree_of_one_splits_everything():
    assert unsplittable_reason(config(num_attention_heads=9, num_key_value_heads=3, intermediate_size=7), 1) is None


# ---- shard_model: two ranks cut in one process ---------------------------------------------------------------


def tiny_llama(kv_heads: int = 2, *, tied: bool = False, bias: bool = False, vocab: int = 509):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    if bias:  # transformers starts biases at zero: make them tell the ranks apart
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.data.normal_()
    return model


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_the_ranks_weights_put_back_together_are_the_model(kv_heads):
    model = tiny_llama(kv_heads)
    whole = {name: param.detach().clone() for name, param in model.named_parameters()}
    shards = cut(model, 2)
    kv_rows = 16 * (kv_heads // 2 if kv_heads >= 2 else 1)
    for i in range(2):
        prefix = f"model.layers.{i}"
        layers = [shard.model.layers[i] for shard in shards]
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert attn.q_proj.weight.shape == (32, 64)
            assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (kv_rows, 64)
            assert attn.o_proj.weight.shape == (64, 32)
            assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (64, 64)
            assert mlp.down_proj.weight.shape == (64, 64)
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = [getattr(layer.self_attn, name).weight for layer in layers]
            expected = whole[f"{prefix}.self_attn.{name}.weight"]
            if name == "q_proj" or kv_heads >= 2:
                assert torch.equal(torch.cat(rows), expected), name
            else:  # the one KV head, on both ranks
                assert torch.equal(rows[0], expected) and torch.equal(rows[1], expected), name
        for name in ("gate_proj", "up_proj"):
            rows = [getattr(layer.mlp, name).weight for layer in layers]
            assert torch.equal(torch.cat(rows), whole[f"{prefix}.mlp.{name}.weight"]), name
        columns = [layer.self_attn.o_proj.weight for layer in layers]
        assert torch.equal(torch.cat(columns, dim=1), whole[f"{prefix}.self_attn.o_proj.weight"])
        columns = [layer.mlp.down_proj.weight for layer in layers]
        assert torch.equal(torch.cat(columns, dim=1), whole[f"{prefix}.mlp.down_proj.weight"])
        for name in ("input_layernorm", "post_attention_layernorm"):  # replicated
            for layer in layers:
                assert torch.equal(getattr(layer, name).weight, whole[f"{prefix}.{name}.weight"])
    for name, module in (("model.embed_tokens", "embed"), ("lm_head", "head")):
        parts = [shard.model.embed_tokens.weight if module == "embed" else shard.lm_head.weight for shard in shards]
        assert [tuple(p.shape) for p in parts] == [(255, 64), (255, 64)]
        joined = torch.cat(parts)
        assert torch.equal(joined[:509], whole[f"{name}.weight"])
        assert not joined[509:].any()  # the padded row is zeros
    for rank, shard in enumerate(shards):
        cfg = shard.config
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 1, 16)
        assert cfg.hidden_size == 64 and cfg.intermediate_size == 128  # the model's, not the shard's
        assert shard_of(shard).plan == shard_plan(model.config, rank, 2)
        linears = [m for m in shard.modules() if isinstance(m, torch.nn.Linear)]
        assert not any(m.weight.requires_grad for m in linears)
    assert shard_of(model) is None


@pytest.mark.parametrize(
    ("kv_heads", "tied", "bias", "world"),
    [(2, False, False, 2), (1, False, False, 2), (2, True, True, 2), (2, False, True, 4)],
    ids=["kv-split", "kv-replicated", "tied-biased", "four-ranks"],
)
def test_a_shard_read_from_the_checkpoint_is_the_shard_cut_from_the_model(tmp_path, kv_heads, tied, bias, world):
    """Each rank reads only its slices of the safetensors files (several, with an index) and ends with the
    parameters and buffers a rank that loaded the whole model and cut it has, the output layer still tied."""
    model = tiny_llama(kv_heads, tied=tied, bias=bias)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(set(checkpoint_files(tmp_path).values())) > 1
    for rank, cut_shard in enumerate(cut(model, world)):
        shell = shell_of(model)
        shard_model(shell, rank, world, None)
        load_shard_weights(shell, tmp_path)
        read = dict(shell.named_parameters())
        expected = dict(cut_shard.named_parameters())
        assert read.keys() == expected.keys()
        for name, param in expected.items():
            assert torch.equal(read[name], param), (rank, name)
        assert not any(param.is_meta for param in shell.parameters())
        assert (shell.lm_head.weight is shell.model.embed_tokens.weight) == tied
        buffers = dict(cut_shard.named_buffers())
        assert all(torch.equal(buffer, buffers[name]) for name, buffer in shell.named_buffers())


def test_a_shard_is_read_only_from_safetensors_that_have_every_tensor(tmp_path):
    model = tiny_llama()
    shell = shell_of(model)
    shard_model(shell, 0, 2, None)
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        load_shard_weights(shell, tmp_path)
    from safetensors.torch import save_file

    weights = {name: param.detach().contiguous() for name, param in model.named_parameters()}
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no tensor model\.norm\.weight"):
        load_shard_weights(shell, tmp_path)
    with pytest.raises(ValueError, match="cut by shard_model"):
        load_shard_weights(shell_of(model), tmp_path)


def test_a_sharded_models_partial_products_sum_to_the_whole():
    """Row-parallel o/down: each rank's product is a partial sum; the ranks' sums (what the all-reduce
    adds) are the whole model's product, the bias counted once (rank 0 keeps it). Column-parallel q/k/v
    and gate/up: each rank's rows of the product."""
    model = tiny_llama(bias=True)
    shards = cut(model, 2)
    torch.manual_seed(1)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        for i in range(2):
            full_mlp = model.model.layers[i].mlp
            parts = [shard.model.layers[i].mlp for shard in shards]
            partial = [mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)) for mlp in parts]  # llama's act is silu
            torch.testing.assert_close(partial[0] + partial[1], full_mlp(x), rtol=1e-5, atol=1e-5)
            full_attn = model.model.layers[i].self_attn
            attn = [shard.model.layers[i].self_attn for shard in shards]
            assert attn[0].o_proj.bias is not None and attn[1].o_proj.bias is None
            assert parts[0].down_proj.bias is not None and parts[1].down_proj.bias is None
            q = torch.cat([a.q_proj(x) for a in attn], dim=-1)
            torch.testing.assert_close(q, full_attn.q_proj(x))
            heads = torch.randn(5, 64)  # the attention's output, heads side by side
            o = attn[0].o_proj(heads[:, :32]) + attn[1].o_proj(heads[:, 32:])
            torch.testing.assert_close(o, full_attn.o_proj(heads), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocabulary_parallel_embedding_and_logits(monkeypatch, tied):
    """`TensorParallelShard.embed`: each rank's lookup (zeros outside its rows) summed over the ranks is
    the embedding; the ranks' logits side by side, cut to the vocabulary, are the model's logits
    (`gather_logits`' concatenation, without the all-gather). A tied head stays tied to its embedding."""
    model = tiny_llama(tied=tied)
    shards = cut(model, 2)
    ids = torch.tensor([0, 1, 254, 255, 256, 508, 3])
    lookups = []
    for shard in shards:
        tp = shard_of(shard)
        monkeypatch.setattr(tp, "all_reduce", lambda x: x)
        lookups.append(tp.embed(ids, shard.model.embed_tokens.weight))
        assert (shard.lm_head.weight is shard.model.embed_tokens.weight) is tied
    assert torch.equal(lookups[0] + lookups[1], model.model.embed_tokens(ids))
    assert not lookups[1][:3].any() and not lookups[0][3:6].any()  # each id in one rank's rows only
    hidden = torch.randn(3, 64)
    with torch.inference_mode():
        logits = torch.cat([shard.lm_head(hidden) for shard in shards], dim=-1)
        assert logits.shape == (3, 510)
        torch.testing.assert_close(logits[:, :509], model.lm_head(hidden))


def test_shard_model_refuses_what_does_not_split():
    model = tiny_llama()
    with pytest.raises(ValueError, match="tensor_parallel_degree=3 does not divide the model's 4 attention heads"):
        shard_model(model, 0, 3, None)
    assert shard_of(model) is None and model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)


# ---- LoRA adapters: each rank's shard (issue #36) ------------------------------------------------------------

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def random_adapter(model, rank: int = 4, seed: int = 3):
    """A LoRA adapter of every projection of `model` (A and the scaled B, random), as `read_adapter` keeps one."""
    from pathlib import Path

    from lmiserve.engine.lora.adapters import LoraAdapter

    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for i in range(len(model.model.layers)):
        for short in LORA_MODULES:
            group = "mlp" if short in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            path = f"model.layers.{i}.{group}.{short}"
            linear = model.get_submodule(path)
            a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
            modules[path] = (a, torch.randn(linear.out_features, rank, generator=generator))
    return LoraAdapter("x", Path("/nowhere"), modules, rank, 8.0, None, 0.0)


def rank_slices(shard) -> dict[str, slice]:
    """The rows (column-parallel) or input columns (row-parallel) of each projection a rank keeps."""
    plan = shard_of(shard).plan
    d = plan.head_dim
    q = slice(plan.q_first * d, (plan.q_first + plan.q_heads) * d)
    kv = slice(plan.kv_first * d, (plan.kv_first + plan.kv_heads) * d)
    inter = plan.part(128)  # (the tiny Llama's intermediate size)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q, "gate_proj": inter, "up_proj": inter,
            "down_proj": inter}  # fmt: skip


@pytest.mark.parametrize(("kv_heads", "world"), [(2, 2), (1, 2), (2, 4)], ids=["kv-split", "kv-replicated", "four"])
def test_the_ranks_adapter_shards_give_the_merged_models_products(kv_heads, world):
    """`shard_adapter` cuts B's rows of a column-parallel projection and A's input columns of a row-parallel
    one: each rank's product plus its delta is its rows of the merged linear's product (q/k/v, gate/up; a
    replicated KV head's whole), or a partial sum that, summed over the ranks as the all-reduce does, is the
    merged linear's product (o, down)."""
    from lmiserve.engine.model.sharding import shard_adapter

    model = tiny_llama(kv_heads)
    adapter = random_adapter(model)
    shards = cut(model, world)
    pieces = [shard_adapter(adapter, shard) for shard in shards]
    assert all(piece.id == adapter.id and piece.name == adapter.name for piece in pieces)
    torch.manual_seed(2)
    with torch.inference_mode():
        for path, (a, b) in adapter.modules.items():
            short = path.rsplit(".", 1)[-1]
            linear = model.get_submodule(path)
            x = torch.randn(5, linear.in_features)
            merged = linear(x) + x @ a.T @ b.T  # W x + s B A x: the PEFT-merged linear
            outputs = []
            for shard, piece in zip(shards, pieces, strict=True):
                part, (a_r, b_r) = rank_slices(shard)[short], piece.modules[path]
                x_r = x[:, part] if short in ROW_PARALLEL else x
                outputs.append(shard.get_submodule(path)(x_r) + x_r @ a_r.T @ b_r.T)
                if short not in ROW_PARALLEL:
                    torch.testing.assert_close(outputs[-1], merged[:, part], rtol=1e-5, atol=1e-5)
                    assert torch.equal(a_r, a) and b_r.shape[0] == part.stop - part.start
                else:
                    assert torch.equal(b_r, b) and a_r.shape[1] == part.stop - part.start
            if short in ROW_PARALLEL:
                torch.testing.assert_close(sum(outputs), merged, rtol=1e-5, atol=1e-5)


def test_phi3s_fused_linears_and_their_adapters_keep_each_ranks_runs_of_rows(tmp_path):
    """Phi-3's qkv_proj keeps a rank's q rows, then its k rows, then its v rows; gate_up_proj its gate rows, then
    its up rows: cut from the model, read from the checkpoint, and of an adapter's B alike."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from transformers import Phi3Config, Phi3ForCausalLM

    from lmiserve.engine.lora.adapters import LoraAdapter
    from lmiserve.engine.model.sharding import shard_adapter

    config = Phi3Config(vocab_size=509, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    paths = ("model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj")
    b = {path: torch.randn(model.get_submodule(path).out_features, 4) for path in paths}
    adapter = LoraAdapter("x", Path("/nowhere"), {p: (torch.randn(4, 64), b[p]) for p in paths}, 4, 8.0, None, 0.0)
    qkv, gate_up = (model.get_submodule(path).weight for path in paths)

    def rows(weight: torch.Tensor, path: str, rank: int) -> torch.Tensor:
        """A rank's rows of a fused weight (heads of 16: q rows 64, 32 a rank; k's and v's 32, 16 a rank; gate's
        and up's 128, 64 a rank)."""
        if path == paths[0]:
            q, kv = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16)
            return torch.cat([weight[q], weight[64:][kv], weight[96:][kv]])
        inter = slice(64 * rank, 64 * rank + 64)
        return torch.cat([weight[inter], weight[128:][inter]])

    for rank, shard in enumerate(cut(model, 2)):
        assert torch.equal(shard.get_submodule(paths[0]).weight, rows(qkv, paths[0], rank))
        assert torch.equal(shard.get_submodule(paths[1]).weight, rows(gate_up, paths[1], rank))
        piece = shard_adapter(adapter, shard)
        for path in paths:
            assert torch.equal(piece.modules[path][1], rows(b[path], path, rank))
        with init_empty_weights(include_buffers=False):
            shell = Phi3ForCausalLM(copy.deepcopy(config)).eval()
        shard_model(shell, rank, 2, None)
        load_shard_weights(shell, tmp_path)
        expected = dict(shard.named_parameters())
        assert all(torch.equal(param, expected[name]) for name, param in shell.named_parameters())


def test_a_rank_reads_its_shard_of_a_peft_adapter(tiny_model_dir, lora_adapter_dirs):
    """A rank's `LoraManager` reads a PEFT folder against its cut model (checked against the whole linears'
    shapes) and keeps its shard under the load id the step names."""
    from transformers import AutoModelForCausalLM

    from lmiserve.engine.core.step import AdapterRef
    from lmiserve.engine.lora.adapters import FAST_PATH_MODULES, read_adapter
    from lmiserve.engine.lora.manager import LoraManager
    from lmiserve.engine.model.sharding import shard_adapter

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    whole = read_adapter(lora_adapter_dirs["beta"], model, name="beta", max_rank=16)
    ref = AdapterRef("beta", 77, str(lora_adapter_dirs["beta"]))
    for shard in cut(model, 2):
        manager = LoraManager(shard, 16, FAST_PATH_MODULES, lambda adapter, shard=shard: shard_adapter(adapter, shard))
        got = manager.get(ref)
        expected = shard_adapter(whole, shard)
        assert got.id == 77 and manager.get(ref) is got and manager.kept() == [77]
        assert got.modules.keys() == expected.modules.keys() == whole.modules.keys()
        for path, (a, b) in expected.modules.items():
            assert torch.equal(got.modules[path][0], a) and torch.equal(got.modules[path][1], b), path
        assert got.nbytes < whole.nbytes
        manager.drop([77])
        assert manager.kept() == []


def test_shard_adapter_refuses_what_it_cannot_cut():
    import dataclasses

    from lmiserve.engine.model.sharding import shard_adapter

    model = tiny_llama()
    adapter = random_adapter(model)
    with pytest.raises(ValueError, match="cut by shard_model"):
        shard_adapter(adapter, model)
    shard = cut(model, 2)[0]
    head = {"lm_head": (torch.zeros(4, 64), torch.zeros(509, 4))}
    with pytest.raises(ValueError, match="adapts lm_head, which tensor parallelism does not shard"):
        shard_adapter(dataclasses.replace(adapter, modules=head), shard)


# ---- settings ---------------------------------------------------------------------------------------------


def test_tensor_parallel_size_is_the_degree_by_key_alias_flag_and_environment(monkeypatch):
    from lmiserve import cli

    assert Settings.from_options({"tensor_parallel_size": "2"}).tensor_parallel_degree == "2"
    assert Settings.from_options({"option.tensor_parallel_degree": "4"}).tensor_parallel_degree == "4"
    assert load_settings({}, environ={"OPTION_TENSOR_PARALLEL_DEGREE": "8"}).tensor_parallel_degree == "8"
    assert Settings.from_options({"tensor_parallel_degree": " MAX "}).tensor_parallel_degree == "max"
    seen: dict = {}
    monkeypatch.setattr(cli, "serve", lambda settings, services=None, held=None: seen.update(settings=settings) or 0)
    argv = ["serve", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3",
            "--master-port", "29511", "--step-timeout", "2.5"]  # fmt: skip
    assert cli.main(argv) == 0
    s = seen["settings"]
    assert (s.tensor_parallel_degree, s.nnodes, s.node_rank, s.master_addr, s.master_port, s.step_timeout) == (
        "4",
        2,
        1,
        "10.1.2.3",
        29511,
        2.5,
    )
    assert s.sources["tensor_parallel_degree"] == "command line --tensor-parallel-size"
    assert cli.main(["serve", "--tensor-parallel-degree", "2"]) == 0
    assert seen["settings"].tensor_parallel_degree == "2"


def test_defaults_are_one_node_and_a_five_minute_step():
    s = load_settings({}, environ={})
    assert (s.tensor_parallel_degree, s.nnodes, s.node_rank, s.master_addr, s.master_port, s.step_timeout) == (
        None, 1, 0, "127.0.0.1", None, 300.0
    )  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "leader", "MASTER_PORT": "1234"},
         (2, 1, "leader", 1234)),
        ({"PET_NNODES": "4", "PET_NODE_RANK": "3"}, (4, 3, "127.0.0.1", None)),
        ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "lws-0.lws"},
         (2, 1, "lws-0.lws", None)),
        # LeaderWorkerSet's, then torchrun's, then the plain names: the last wins
        ({"LWS_GROUP_SIZE": "2", "PET_NNODES": "4", "NNODES": "8", "LWS_WORKER_INDEX": "1", "PET_NODE_RANK": "2",
          "LWS_LEADER_ADDRESS": "a", "MASTER_ADDR": "b"}, (8, 2, "b", None)),
        ({"LWS_GROUP_SIZE": "2", "PET_NNODES": "4", "LWS_WORKER_INDEX": "1", "PET_NODE_RANK": "3"},
         (4, 3, "127.0.0.1", None)),
        # the option's own variables beat the shortcuts
        ({"NNODES": "2", "OPTION_NNODES": "4", "MASTER_ADDR": "b", "OPTION_MASTER_ADDR": "c"}, (4, 0, "c", None)),
    ],
)  # fmt: skip
def test_node_variables_map_to_settings(environ, expected):
    s = load_settings({}, environ={"OPTION_TENSOR_PARALLEL_DEGREE": "8", **environ})
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port) == expected
    if "NNODES" in environ and "OPTION_NNODES" not in environ:
        assert s.sources["nnodes"] == "environment NNODES"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_invariant": "true"}, "tensor_parallel_degree=2 cannot be combined with batch_invariant"),
        ({"dtype": "int8"}, "tensor_parallel_degree=2 cannot be combined with dtype int8/int4"),
        ({"dtype": "int4"}, "tensor_parallel_degree=2 cannot be combined with dtype int8/int4"),
        ({"fast_path": "false"}, "tensor_parallel_degree=2 cannot be combined with fast_path=false"),
        ({"nnodes": "3"}, "tensor_parallel_degree=2 is not a multiple of nnodes=3"),
        ({"nnodes": "2", "node_rank": "2"}, "node_rank=2 must be below nnodes=2"),
    ],
)  # fmt: skip
def test_what_tensor_parallelism_refuses_is_one_line_naming_the_option(options, message):
    with pytest.raises(ConfigError) as caught:
        Settings.from_options({"tensor_parallel_degree": "2", **options})
    text = str(caught.value)
    assert message in text and "\n" not in text, text


@pytest.mark.parametrize(
    "options",
    [
        {"speculative_config": '{"model": "/some/draft", "num_speculative_tokens": 3}'},
        {"speculative_draft_model": "/some/draft"},
        {"kv_cache_dtype": "fp8"},
        {"quantize": "fp8"},
    ],
)
def test_a_draft_model_an_fp8_kv_cache_and_quantize_combine_with_tensor_parallelism(options):
    """(Each rank loads the draft whole; its pool stores fp8; its shard is quantized: the integration tests.)"""
    assert Settings.from_options({"tensor_parallel_degree": "2", **options}).tensor_parallel_degree == "2"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nnodes": "2"}, "nnodes=2 needs tensor_parallel_degree set to the ranks of all nodes"),
        ({"nnodes": "2", "tensor_parallel_degree": "1"},
         "nnodes=2 needs tensor_parallel_degree set to the ranks of all nodes"),
        ({"node_rank": "1"}, "node_rank=1 must be below nnodes=1"),
        ({"tensor_parallel_degree": "0"}, "expected a positive whole number or max"),
        ({"tensor_parallel_degree": "two"}, "expected a positive whole number or max"),
        ({"nnodes": "0"}, "nnodes"),
        ({"master_port": "70000"}, "master_port"),
        ({"step_timeout": "0"}, "step_timeout"),
    ],
)  # fmt: skip
def test_node_options_without_tensor_parallelism_are_refused(options, message):
    with pytest.raises(ConfigError) as caught:
        Settings.from_options(options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "options",
    [
        {"tensor_parallel_degree": "2"},
        {"tensor_parallel_degree": "4", "nnodes": "2", "node_rank": "1"},
        {"tensor_parallel_degree": "2", "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'},
        {"tensor_parallel_degree": "2", "dtype": "bf16", "enable_prefix_caching": "true"},
        {"tensor_parallel_degree": "1", "enable_lora": "true", "dtype": "int8", "fast_path": "false"},
        {"tensor_parallel_degree": "2", "enable_lora": "true", "max_loras": "2"},  # each rank its adapters' shard
        {"tensor_parallel_degree": "3", "lora_modules": "a=/nowhere"},
        {"tensor_parallel_degree": "1", "batch_invariant": "true"},
    ],
)
def test_what_tensor_parallelism_serves_is_accepted(options):
    Settings.from_options(options)


def test_degree_max_is_one_on_a_cpu_and_refuses_nothing_there():
    from lmiserve.models.compose import tensor_parallel_degree

    cpu = torch.device("cpu")
    for options in ({"tensor_parallel_degree": "max"}, {"tensor_parallel_degree": "max", "enable_lora": "true"}):
        assert tensor_parallel_degree(Settings.from_options(options), cpu) == 1
    assert tensor_parallel_degree(Settings.from_options({}), cpu) == 1
    assert tensor_parallel_degree(Settings.from_options({"tensor_parallel_degree": "2"}), cpu) == 2


def test_degree_max_on_several_gpus_refuses_what_tensor_parallelism_cannot_serve(monkeypatch):
    """`max` is checked when it resolves: on a node with 2 GPUs it means 2 ranks, so what a
    ``tensor_parallel_degree=2`` refuses (int8, fast_path=false, ...) must be refused too, not silently
    dropped by the tensor-parallel engine (which loads the workers' weights in the dtype it is given); LoRA
    is served over the ranks."""
    from lmiserve.models.compose import tensor_parallel_degree

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    assert tensor_parallel_degree(Settings.from_options({"tensor_parallel_degree": "max"}), cuda) == 2
    settings = Settings.from_options({"tensor_parallel_degree": "max", "enable_lora": "true"})
    assert tensor_parallel_degree(settings, cuda) == 2  # adapters are served over the ranks
    for option, what in [
        ("dtype=int8", "dtype int8/int4"),
        ("fast_path=false", "fast_path=false"),
    ]:
        key, value = option.split("=")
        settings = Settings.from_options({"tensor_parallel_degree": "max", key: value})
        with pytest.raises(ValueError, match=f"cannot be combined with {what}"):
            tensor_parallel_degree(settings, cuda)


def test_a_node_needs_a_gpu_for_each_of_its_ranks(monkeypatch):
    from lmiserve.models.compose import tensor_parallel_degree

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    assert tensor_parallel_degree(Settings.from_options({"tensor_parallel_degree": "4", "nnodes": "2"}), cuda) == 4
    with pytest.raises(ValueError, match="tensor_parallel_degree=4 needs 4 GPUs on each of 1 node"):
        tensor_parallel_degree(Settings.from_options({"tensor_parallel_degree": "4"}), cuda)
    with pytest.raises(ValueError, match="give device=cuda .*, not cuda:1"):
        tensor_parallel_degree(Settings.from_options({"tensor_parallel_degree": "2"}), torch.device("cuda", 1))


def test_worker_spec_shares_the_nodes_memory_and_picks_the_port(monkeypatch, tmp_path):
    from lmiserve.engine import factory
    from lmiserve.models import compose
    from lmiserve.models.load import load_causal_lm, load_model_shell

    monkeypatch.setattr(factory, "available_memory", lambda: 8 * 2**30)
    cpu = torch.device("cpu")
    one = compose.worker_spec(Settings.from_options({"tensor_parallel_degree": "2"}), str(tmp_path), cpu, 2)
    assert (one.world, one.nnodes, one.local_world, list(one.local_ranks)) == (2, 1, 2, [0, 1])
    assert one.config.kv_cache_memory_bytes == 2 * 2**30 // 2  # a quarter of the memory, shared by 2 ranks
    assert one.master_port != 29500 and 1 <= one.master_port <= 65535  # a free port of its own
    assert one.dtype == "float32" and one.device == "cpu" and one.step_timeout == 300.0
    # the workers load the model as the server does (the engine imports no model loading of its own)
    assert (one.load_model, one.load_shell) == (load_causal_lm, load_model_shell)
    settings = Settings.from_options(
        {"tensor_parallel_degree": "4", "nnodes": "2", "node_rank": "1", "step_timeout": "7", "cpu_autotune": "true"}
    )
    two = compose.worker_spec(settings, str(tmp_path), cpu, 4)
    assert (two.local_world, list(two.local_ranks), two.master_port, two.step_timeout) == (2, [2, 3], 29500, 7.0)
    assert two.config.cpu_autotune is False
    given = Settings.from_options({"tensor_parallel_degree": "2", "kv_cache_memory_bytes": "1000000"})
    assert compose.worker_spec(given, str(tmp_path), cpu, 2).config.kv_cache_memory_bytes == 1000000  # per worker


def test_node_options_without_tensor_parallelism_are_named_as_ignored(caplog):
    """master_addr, master_port and step_timeout set on purpose without tensor parallelism: one warning
    line; a launcher's MASTER_ADDR/MASTER_PORT (torchrun, LeaderWorkerSet export them) say nothing."""
    from lmiserve.models.compose import engine_config

    with caplog.at_level("WARNING", logger="lmiserve.models.compose"):
        engine_config(load_settings({}, environ={"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}))
        assert "tensor parallelism" not in caplog.text
        engine_config(load_settings({"step_timeout": "30"}, environ={"OPTION_MASTER_PORT": "29500"}))
    assert (
        "master_port (environment OPTION_MASTER_PORT), step_timeout (command line): only for tensor parallelism "
        "(tensor_parallel_degree > 1); ignored" in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmiserve.models.compose"):
        engine_config(load_settings({"step_timeout": "30"}, environ={"OPTION_TENSOR_PARALLEL_DEGREE": "2"}))
    assert "ignored" not in caplog.text
