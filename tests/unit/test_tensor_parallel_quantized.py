"""Quantized checkpoints over tensor parallelism, without processes (engine/model/shard_quantized.py): each rank's
shard of an fp8 (per channel, per tensor, FBGEMM, block-wise, NVIDIA ModelOpt's), AWQ or GPTQ checkpoint, read from the checkpoint's
own tensors, is the shard of the model one process loads from it: every linear's weight, dequantized, equals
the rank's cut of the whole model's (exactly, fp32), and the rank keeps the format where one process does
(the CPU int4 kernel's layer for AWQ; an `Fp8Linear` where the device multiplies fp8); a block-wise fp8 mixture
of experts' experts are read as float through the blocks each rank's slice covers; a `quantize` the checkpoint
does not hold is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.float_weights import float_state, weight_of
from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.config import Settings
from lmiserve.engine.model import cpu_codes, cpu_experts, fp8_gemv, quant_formats
from lmiserve.engine.model.int8_weights import Int8WeightLinear
from lmiserve.engine.model.quant_formats import Fp8Linear
from lmiserve.engine.model.quantize import Int4Linear, int4_available
from lmiserve.engine.model.shard_checkpoint import load_shard_weights
from lmiserve.engine.model.shard_quantized import whole_groups
from lmiserve.engine.model.sharding import ROW_PARALLEL, column_run, keep_runs, row_runs, shard_model, shard_of
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm, load_model_shell
from lmiserve.models.quantized_load import checkpoint_quantization

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = {  # id: (quant_pack format, act_order, group)
    "fp8-channel": ("fp8-channel", False, 0),
    "fp8-tensor": ("fp8-tensor", False, 0),
    "fbgemm-fp8": ("fbgemm-fp8", False, 0),
    "fp8-block-b128": ("fp8-block", False, 128),  # (Qwen3's; at 4 ranks a rank's 64 rows of q are half a block)
    "awq-g128": ("awq", False, 128),
    "gptq-g64": ("gptq", False, 64),
    "gptq-g64-desc-act": ("gptq", True, 64),
    "gptq-int8-g64": ("gptq-int8", False, 64),  # symmetric 8-bit codes, four a word (Qwen's GPTQ-Int8)
    "w4a16-asym-g32": ("w4a16-asym", False, 32),  # compressed-tensors' pack-quantized (helpers.compressed_ints)
    "w4a16-channel": ("w4a16", False, -1),
    "w8a8": ("w8a8", False, 0),  # compressed-tensors' int8 (int-quantized, by channel)
    "modelopt-fp8": ("modelopt-fp8", False, 0),  # NVIDIA ModelOpt's export: a scale a tensor
    "modelopt-fp8-block": ("modelopt-fp8-block", False, 0),  # its FP8_PB_WO: blocks of 128 x 128
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-quantized")
    made = {}
    for bias in (False, True):
        model = quantizable_llama(25, bias)
        for case, (fmt, act_order, group) in CASES.items():
            folder = write_checkpoint(model, root / f"{case}{'-bias' if bias else ''}", fmt, group or 128, act_order)
            made[folder.name] = folder
    return made


def rank_shard(folder: Path, rank: int, world: int, dtype: str = "fp32") -> torch.nn.Module:
    loaded = load_model_shell(folder, dtype=dtype, device="cpu")
    shard_model(loaded.model, rank, world, None)
    load_shard_weights(loaded.model, folder, checkpoint_quantization(folder, None), torch.device("cpu"))
    return loaded.model


def expected_cut(whole: torch.nn.Module, name: str, world_shard) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rank's cut of the whole model's linear `name`: its weight (dequantized) and its bias."""
    plan = world_shard.plan
    module = whole.get_submodule(name)
    weight, bias = weight_of(module), getattr(module, "bias", None)
    short = name.rpartition(".")[2]
    runs = row_runs(plan, short, weight.shape[0])
    if runs is not None:
        return keep_runs(weight, runs), None if bias is None else keep_runs(bias.detach().float(), runs)
    assert short in ROW_PARALLEL
    kept = None if bias is None or plan.rank else bias.detach().float()
    return weight[:, column_run(plan, short, weight.shape[1])], kept


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_each_ranks_quantized_linears_are_its_cut_of_the_whole_models(checkpoints, case, world, bias):
    folder = checkpoints[f"{case}{'-bias' if bias else ''}"]
    whole = load_causal_lm(folder, dtype="fp32", device="cpu").model
    for rank in range(world):
        shard = rank_shard(folder, rank, world)
        for name, module in shard.named_modules():
            if name.rpartition(".")[2] not in LINEARS:
                continue
            weight, kept = expected_cut(whole, name, shard_of(shard))
            assert torch.equal(weight_of(module), weight), (case, rank, name)
            got = getattr(module, "bias", None)
            assert (got is None) == (kept is None), (case, rank, name)
            if kept is not None:
                assert torch.equal(got.detach().float(), kept), (case, rank, name)
            if (
                case in ("awq-g128", "w4a16-asym-g32") and int4_available()
            ):  # the CPU int4 kernel's layer, as one process's
                assert isinstance(module, Int4Linear), (rank, name, type(module))
        # the rest (embeddings, norms) read as a float checkpoint's
        assert torch.equal(shard.model.norm.weight, whole.model.norm.weight)


@pytest.mark.parametrize("case", ["fp8-channel", "fp8-tensor", "awq-g128", "gptq-g64-desc-act", "gptq-int8-g64"])
def test_a_bf16_rank_keeps_each_linear_as_an_fp32_rank_does(checkpoints, case):
    """A CPU rank computing in bf16 (a GPU's `serving.properties` on a CPU host) keeps every linear of its shard
    as an fp32 rank does (the same module type: the CPU kernels' layers, with the same weights exactly; or
    de-quantized where fp32 de-quantizes too, fp32's weights rounded to bf16 once); the rest of its shard is bf16."""
    folder = checkpoints[case]
    for rank in range(2):
        fp32, bf16 = rank_shard(folder, rank, 2), rank_shard(folder, rank, 2, "bf16")
        kinds = set()
        for name, module in fp32.named_modules():
            if name.rpartition(".")[2] not in LINEARS:
                continue
            other = bf16.get_submodule(name)
            assert type(other) is type(module), (case, rank, name, type(module), type(other))
            want = weight_of(module).float()
            if type(module) is torch.nn.Linear:  # (act-order's row-parallel parts on a CPU rank)
                want = want.to(torch.bfloat16).float()
            assert torch.equal(weight_of(other).float(), want), (case, rank, name)
            kinds.add(type(module).__name__)
        assert kinds != {"Linear"}, (case, kinds)  # a kept format, not all de-quantized
        assert bf16.model.norm.weight.dtype == torch.bfloat16


def test_an_fp8_rank_keeps_fp8_weights_and_their_scales_where_the_device_multiplies_fp8(checkpoints, monkeypatch):
    """Where `_scaled_mm` runs (Hopper, Ada: here pretended), each rank's fp8 linears are `Fp8Linear`s of its rows'
    fp8 values and scales (a row-parallel linear: its columns, every scale): fp8's memory on every rank."""
    monkeypatch.setattr(quant_formats, "fp8_scaled_mm_supported", lambda device: True)
    folder = checkpoints["fp8-channel"]
    from safetensors.torch import load_file

    stored = load_file(folder / "model.safetensors")
    shard = rank_shard(folder, 1, 2)
    q, o = shard.model.layers[0].self_attn.q_proj, shard.model.layers[0].self_attn.o_proj
    assert isinstance(q, Fp8Linear) and isinstance(o, Fp8Linear)
    assert q.weight.dtype == o.weight.dtype == torch.float8_e4m3fn
    at = "model.layers.0.self_attn"
    whole_q, whole_o = stored[f"{at}.q_proj.weight"], stored[f"{at}.o_proj.weight"]
    assert torch.equal(q.weight.view(torch.uint8), whole_q[128:].view(torch.uint8))
    assert torch.equal(q.scales, stored[f"{at}.q_proj.weight_scale"].reshape(-1)[128:])
    assert torch.equal(o.weight.view(torch.uint8), whole_o[:, 128:].contiguous().view(torch.uint8))
    assert torch.equal(o.scales, stored[f"{at}.o_proj.weight_scale"].reshape(-1))


@pytest.mark.parametrize("case", ["fp8-block-b128", "modelopt-fp8-block"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_block_wise_fp8_rank_keeps_fp8_weights_where_it_is_asked_to(checkpoints, monkeypatch, world, case):
    """Where a rank keeps block-wise fp8 (`weights_kept_for`: bf16 would not fit the GPU, or forced), its
    column-parallel linears are `Fp8Linear`s of its rows with each row's block scales (a rank's rows need not be
    whole blocks), its row-parallel ones of its columns (o's 64 inputs a rank at 4 ranks, ranks 1 and 3 starting
    inside a block of 128: a scale a row). Every weight is the rank's exact cut."""
    from lmiserve.engine.model import shard_checkpoint

    monkeypatch.setattr(shard_checkpoint, "weights_kept_for", lambda *args: True)
    folder = checkpoints[case]
    whole = load_causal_lm(folder, dtype="fp32", device="cpu").model
    kinds = set()
    for rank in range(world):
        shard = rank_shard(folder, rank, world)
        for name, module in shard.named_modules():
            short = name.rpartition(".")[2]
            if short not in LINEARS:
                continue
            weight, _ = expected_cut(whole, name, shard_of(shard))
            assert torch.equal(weight_of(module), weight), (rank, name)
            assert isinstance(module, Fp8Linear), (rank, name)  # each row's blocks' scales; one block: one a row
            assert module.scales.shape == ((weight.shape[0], 2) if weight.shape[1] > 128 else (weight.shape[0],))
            kinds.add((short, weight.shape[1]))
    row_parallel = {k for k in kinds if k[0] in ("o_proj", "down_proj")}
    assert row_parallel == ({("o_proj", 128), ("down_proj", 256)} if world == 2 else
                            {("o_proj", 64), ("down_proj", 128)})  # fmt: skip
    assert ("q_proj", 256) in kinds  # (2 blocks of inputs)


INSIDE = {  # case: (format, group, the layer a rank keeps, an odd rank's finer groups' inputs at 2 and 4 ranks)
    "fp8-block-b128": ("fp8-block", 128, Fp8Linear, {2: 64, 4: 32}),
    "modelopt-fp8-block": ("modelopt-fp8-block", 128, Fp8Linear, {2: 64, 4: 32}),
    "awq-g128": ("awq", 128, Int4Linear, {2: 64, 4: 32}),  # (the CPU int4 kernel: groups of a multiple of 32)
    "gptq-int8-g64": ("gptq-int8", 64, Int8WeightLinear, {2: 64, 4: 32}),
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(INSIDE))
def test_a_rank_whose_inputs_start_inside_a_group_keeps_its_format_by_finer_groups(tmp_path, monkeypatch, case, world):
    """down_proj's 384 inputs (3 groups of 128) over 2 or 4 ranks: 192 or 96 a rank, ranks 1-3 starting inside a
    group (a Qwen2-72B AWQ's 29568 over 4: 7392 a rank, 57.75 groups of 128). Each rank keeps the format where one
    process does (fp8 where kept, the CPU int4 kernel, the int8 codes where kept), its inputs read by the finer
    groups whole in them (`whole_groups`: 64 or 32), each with its stored group's scale: its weight is its exact
    cut, and its product that cut's."""
    from lmiserve.engine.model import shard_checkpoint

    monkeypatch.setattr(shard_checkpoint, "weights_kept_for", lambda *args: True)
    fmt, group, layer, fine = INSIDE[case]
    folder = write_checkpoint(quantizable_llama(25, intermediate=384), tmp_path / case, fmt, group)
    whole = load_causal_lm(folder, dtype="fp32", device="cpu").model
    x = torch.randn(3, 384)
    for rank in range(world):
        shard = rank_shard(folder, rank, world)
        for index, part in enumerate(shard.model.layers):
            name = f"model.layers.{index}.mlp.down_proj"
            down = part.mlp.down_proj
            weight, _ = expected_cut(whole, name, shard_of(shard))
            assert isinstance(down, layer), (rank, name, type(down))
            assert torch.equal(weight_of(down), weight), (rank, name)
            columns = column_run(shard_of(shard).plan, "down_proj", 384)
            if isinstance(down, Fp8Linear):  # blocks from the rank's first input (the kernel reads a partial last)
                width = 128 if rank == 0 else fine[world] if rank % 2 else 64  # (rank 2 of 4 starts at 192)
                blocks = -(-down.in_features // width)
                assert down.scales.shape == ((256, blocks) if blocks > 1 else (256,))  # (one block: a scale a row)
                assert blocks == 1 or fp8_gemv.input_block(down.in_features, down.scales) == width
            own = x[:, columns]
            if isinstance(down, Fp8Linear) and down.scales.dim() == 1:
                continue  # (a scale a row: its activations go to fp8 too, `fp8_ops.scaled_product`, as one process's)
            torch.testing.assert_close(
                down(own).float(), own @ weight.t(), rtol=1e-4, atol=1e-4 * weight.abs().max().item()
            )


def test_whole_groups_are_the_finer_groups_a_cut_keeps_its_format_by():
    assert whole_groups(128, 14784, 14784) == 64  # a Qwen2-72B AWQ's down_proj over 2 ranks, rank 1
    assert whole_groups(128, 7392, 7392) == 32  # over 4, rank 1
    assert whole_groups(128, 3696, 3696) == 16  # over 8: still kept fp8; the int4 kernels read groups of 32 or more
    assert whole_groups(128, 0, 4096) == 128  # rank 0, whole groups: the stored ones
    assert whole_groups(128, 100) == 0  # (finer than 16: the cut read by its own groups, de-quantized)
    assert whole_groups(11008, 1376, 1376) == 1376  # a scale a channel: one group, the rank's inputs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel", "w4a16-asym"])
def test_an_fp8_mixture_of_experts_experts_are_read_through_the_scales_each_slice_covers(
    tmp_path, world, fmt, monkeypatch
):
    """Qwen3-MoE in block-wise fp8 (blocks of 16; a rank's 24 or 12 of each expert's 48 intermediate rows are not
    whole blocks), fp8 per channel or compressed-tensors' 4-bit codes (groups of 16, the package's compression of
    each expert's matrices): each rank's experts, router and attention are its cut of the model one process
    dequantizes (the 4-bit experts de-quantized whole, then cut)."""
    from helpers.llama_variants import MOE_ARCHS, build

    write_checkpoint(build(*MOE_ARCHS["qwen3_moe"]), tmp_path, fmt, group=16)
    monkeypatch.setattr(cpu_experts, "kept_for", lambda *args: False)  # (read as floats: the CPU's kept experts'
    with (
        monkeypatch.context() as patched
    ):  # ranks are test_cpu_experts.py's)  # the float model (a CPU would keep fp8 weights fp8: `cpu_codes`)
        patched.setattr(cpu_codes, "fp8_layer", lambda weight, scale, bias: None)
        whole = load_causal_lm(tmp_path, dtype="fp32", device="cpu").model
    import copy

    for rank in range(world):
        expected = copy.deepcopy(whole)
        shard_model(expected, rank, world, None)  # the cut of the dequantized float model
        shard = rank_shard(tmp_path, rank, world)
        got, want = float_state(shard), float_state(expected)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), (rank, name)


def test_a_quantize_the_checkpoint_does_not_hold_is_refused_before_any_worker_starts(checkpoints):
    from lmiserve.models.compose import worker_spec

    folder = checkpoints["fp8-channel"]
    settings = Settings.from_options(
        {"model_id": str(folder), "device": "cpu", "tensor_parallel_degree": "2", "quantize": "awq"}
    )
    with pytest.raises(ModelLoadError, match="quantize=awq, but fp8-channel is a fp8 checkpoint"):
        worker_spec(settings, str(folder), torch.device("cpu"), 2)
    settings = Settings.from_options({"model_id": str(folder), "device": "cpu", "tensor_parallel_degree": "2"})
    spec = worker_spec(settings, str(folder), torch.device("cpu"), 2)
    assert spec.quantization is not None and spec.quantization.method == "fp8"


def test_the_split_benchmark_reports_each_ranks_layer_now_and_before(tmp_path):
    """benchmarks/tp_split_groups.py on a small shape (down_proj's 384 inputs over 2 ranks: 192 each, 1.5 groups)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "split.json"
    command = [sys.executable, str(root / "benchmarks/tp_split_groups.py"), "--hidden", "256", "--intermediate", "384"]
    subprocess.run([*command, "--degrees", "2", "--formats", "awq,fp8-block", "--json", str(out)], check=True)
    formats = json.loads(out.read_text())["formats"]
    awq, fp8 = formats["awq"], formats["fp8-block"]
    assert [r["layer"] for r in awq["served"]] == ["Int4Linear"] * 2 and all(r["exact_cut"] for r in awq["served"])
    assert [r["layer"] for r in awq["before"]] == ["Linear"] * 2
    assert [r["layer"] for r in fp8["served"]] == ["Fp8Linear"] * 2
    assert [r["layer"] for r in fp8["before"]] == ["Fp8Linear", "Linear"]  # (rank 1 starts inside a block)
