"""compressed-tensors' integer checkpoints (``pack-quantized``: llm-compressor's W4A16, W4A16_ASYM and W8A16;
``int-quantized``: W8A8; issue #39): what `quantize` names them, the schemes refused in one line, W8A8 on torch's
int8 kernel, the layouts of earlier releases (zero points packed by
groups, activation-ordered groups' ``weight_g_idx``) and tensors that do not fit. Loading, serving and tensor
parallelism of the package's own checkpoints are in test_quantized_checkpoints.py, test_tensor_parallel_quantized.py
and the tensor-parallel engine's tests (their ``w4a16`` cases)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.compressed_ints import write_compressed
from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.config.sources import load_settings
from lmiserve.engine.model.quantize import Int4Linear, Q8Linear, int4_available
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm
from lmiserve.models.quantized_load import checkpoint_quantization


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed-int4")
    model = quantizable_llama(41)
    return {
        "w4a16": write_checkpoint(model, root / "w4a16", "w4a16", 32),
        "w4a16-asym": write_checkpoint(model, root / "w4a16-asym", "w4a16-asym", 32),
        "fp8": write_checkpoint(model, root / "fp8", "fp8-channel"),
        "float": write_checkpoint(model, root / "float", "float"),
    }


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def with_config(tmp_path: Path, name: str, quantization_config: dict[str, Any]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quantization_config}))
    return folder


def preset(name: str, fmt: str) -> dict[str, Any]:
    """The ``quantization_config`` llm-compressor writes for the compressed-tensors preset scheme `name`."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(name, ["Linear"])}, format=fmt)
    return {**config.model_dump(mode="json"), "quant_method": "compressed-tensors"}


# --- what `quantize` names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [None, "gptq", "awq", "compressed-tensors", "AWQ"])
def test_a_w4a16_checkpoint_is_named_by_gptq_awq_or_compressed_tensors(folders, quantize):
    spec = checkpoint_quantization(folders["w4a16-asym"], quantize)
    assert spec is not None and spec.packed and spec.method == "gptq" and spec.group_size == 32
    assert spec.source == "compressed-tensors"


def test_the_settings_take_compressed_tensors_as_vllm_spells_it():
    assert load_settings({"quantization": "compressed-tensors"}, environ={}).quantize == "compressed-tensors"
    assert load_settings(environ={"OPTION_QUANTIZE": "gptq_marlin"}).quantize == "gptq"


@pytest.mark.parametrize(
    ("case", "quantize", "says"),
    [
        ("w4a16", "fp8", "quantize=fp8, but w4a16 is a gptq checkpoint (compressed-tensors)"),
        ("fp8", "awq", "quantize=awq, but fp8 is a fp8 checkpoint (compressed-tensors)"),
        ("float", "compressed-tensors", "float is not a COMPRESSED-TENSORS checkpoint"),
    ],
)
def test_a_quantize_that_does_not_name_the_checkpoint_is_refused_in_one_line(folders, case, quantize, says):
    with pytest.raises(ModelLoadError) as error:
        load_causal_lm(folders[case], device="cpu", quantize=quantize)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_compressed_tensors_names_an_fp8_checkpoint_too_and_not_a_dummy_load(folders):
    spec = checkpoint_quantization(folders["fp8"], "compressed-tensors")
    assert spec is not None and spec.method == "fp8"
    with pytest.raises(ModelLoadError, match="a dummy load takes fp8, awq or gptq"):
        checkpoint_quantization(folders["float"], "compressed-tensors", load_format="dummy")


# --- schemes lmiserve does not read ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "fmt", "says"),
    [
        ("W4A8", "int-quantized", "(int-quantized) are not supported"),
        ("W8A8", "naive-quantized", "int 8-bit by channel (naive-quantized) are not supported"),
        ("W4A16", "naive-quantized", "int 4-bit by group (naive-quantized) are not supported"),
        ("NVFP4A16", "nvfp4-pack-quantized", "float 4-bit by tensor_group"),
    ],
)
def test_other_compressed_tensors_schemes_are_refused_in_one_line(tmp_path, scheme, fmt, says):
    folder = with_config(tmp_path, scheme, preset(scheme, fmt))
    with pytest.raises(ModelLoadError) as error:
        checkpoint_quantization(folder, None)
    assert says in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_four_bit_weights_with_quantized_activations_are_refused(tmp_path):
    folder = with_config(tmp_path, "w4a8", preset("W4A8", "pack-quantized"))
    with pytest.raises(ModelLoadError, match=r"activations \(W4A8\) are not supported: lmiserve reads W4A16"):
        checkpoint_quantization(folder, None)


def test_groups_of_two_schemes_in_one_checkpoint_are_refused(tmp_path):
    config = preset("W4A16", "pack-quantized")
    fp8 = preset("FP8_DYNAMIC", "float-quantized")["config_groups"]["group_0"]
    config["config_groups"]["group_1"] = {**fp8, "targets": ["re:.*down_proj"]}
    config["format"] = "mixed-precision"
    config["config_groups"]["group_0"]["format"] = "pack-quantized"
    with pytest.raises(ModelLoadError, match="groups of 2 schemes in one checkpoint are not supported"):
        checkpoint_quantization(with_config(tmp_path, "mixed", config), None)


def test_a_scheme_whose_format_is_written_on_its_group_is_read(tmp_path):
    """compressed-tensors writes a group's own ``format`` (a ``mixed-precision`` checkpoint's groups)."""
    config = preset("W4A16", "pack-quantized")
    config["format"], config["config_groups"]["group_0"]["format"] = "mixed-precision", "pack-quantized"
    spec = checkpoint_quantization(with_config(tmp_path, "group-format", config), None)
    assert spec is not None and spec.packed and spec.group_size == 128


# --- the layouts of earlier releases, and tensors that do not fit ---------------------------------------------


def rewritten(source: Path, folder: Path, change) -> Path:
    """A copy of the checkpoint `source` whose tensors `change(name, tensors)` rewrote in place, linear by linear."""
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    flat = load_file(str(source / "model.safetensors"))
    linears: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, part = key.rpartition(".")
        linears.setdefault(name, {})[part] = value
    for name, tensors in linears.items():
        if "weight_packed" in tensors:
            change(name, tensors)
    save_file(
        {f"{n}.{p}": v.contiguous() for n, t in linears.items() for p, v in t.items()},
        str(folder / "model.safetensors"),
    )
    return folder


def packed(values: torch.Tensor, dim: int = 1) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(values.to(torch.int8), 4, packed_dim=dim)


def unpacked(words: torch.Tensor, shape: tuple[int, int], dim: int = 1) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(words, 4, torch.Size(shape), packed_dim=dim).long()


def test_zero_points_packed_by_groups_as_earlier_releases_wrote_them_read_the_same(folders, tmp_path):
    def by_groups(name: str, tensors: dict[str, torch.Tensor]) -> None:
        out, groups = tensors["weight_scale"].shape
        zero = unpacked(tensors["weight_zero_point"], (out, groups), dim=0)
        tensors["weight_zero_point"] = packed(zero, dim=1)  # [out, groups / 8]
        assert tensors["weight_zero_point"].shape == (out, -(-groups // 8))

    folder = rewritten(folders["w4a16-asym"], tmp_path / "zeros-by-groups", by_groups)
    now, then = load_causal_lm(folders["w4a16-asym"], device="cpu"), load_causal_lm(folder, device="cpu")
    for (name, module), (_, earlier) in zip(now.model.named_modules(), then.model.named_modules(), strict=True):
        if isinstance(module, Int4Linear):
            assert torch.equal(module.dequantized(), earlier.dequantized()), name


def test_activation_ordered_groups_are_read_through_weight_g_idx(folders, tmp_path):
    """compressed-tensors removed ``actorder: group`` in 2026, but checkpoints published with it name each input's
    group in ``weight_g_idx``: every weight is ``(q - zero[g]) * scale[g]`` with ``g = weight_g_idx[i]``."""
    expected: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(3)

    def shuffled(name: str, tensors: dict[str, torch.Tensor]) -> None:
        out, inputs = (int(v) for v in tensors["weight_shape"].tolist())
        groups = tensors["weight_scale"].shape[1]
        g_idx = torch.randperm(inputs, generator=generator) % groups  # each input's group, in no order
        codes = torch.randint(-8, 8, (out, inputs), generator=generator)
        tensors["weight_packed"], tensors["weight_g_idx"] = packed(codes), g_idx.to(torch.int32)
        expected[name] = codes.float() * tensors["weight_scale"].float()[:, g_idx]

    folder = rewritten(folders["w4a16"], tmp_path / "g-idx", shuffled)
    loaded = load_causal_lm(folder, device="cpu")
    assert expected
    for name, want in expected.items():
        module = loaded.model.get_submodule(name)
        if int4_available():  # the CPU int4 kernel, the inputs stored in group order (input_order)
            assert isinstance(module, Int4Linear) and module.order is not None, (name, type(module))
        weight = module.dequantized() if isinstance(module, Int4Linear) else module.weight.detach()
        assert torch.equal(weight, want), name


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda t: t.pop("weight_scale"), "weight_scale not in the checkpoint beside its weight_packed"),
        (lambda t: t.update(weight_packed=t["weight_packed"][:, :-1]), "does not hold the 4-bit codes of"),
        (lambda t: t.update(weight_scale=t["weight_scale"][:-1]), "is not a scale for each of"),
        (lambda t: t.update(weight_g_idx=torch.full(t["weight_shape"].tolist()[1:], 99)), "are not its 8 scales"),
    ],
    ids=["no-scale", "short-codes", "short-scales", "g-idx-past-the-groups"],
)
def test_tensors_that_do_not_fit_are_refused_naming_the_linear(folders, tmp_path, change, says):
    def first_only(name: str, tensors: dict[str, torch.Tensor]) -> None:
        if name.endswith("layers.0.self_attn.q_proj"):
            change(tensors)

    folder = rewritten(folders["w4a16"], tmp_path / "broken", first_only)
    with pytest.raises(ModelLoadError) as error:
        load_causal_lm(folder, device="cpu")
    assert str(error.value).startswith("model.layers.0.self_attn.q_proj: ") and says in str(error.value)
    assert "\n" not in str(error.value)


def test_the_load_says_what_it_read(folders, caplog):
    """The start's log line names the format and where the codes run."""
    with caplog.at_level("INFO"):
        load_causal_lm(folders["w4a16"], device="cpu")
    kernel = "on the int4 kernel" if int4_available() else "de-quantized"
    assert any(
        "gptq checkpoint (compressed-tensors): 14" in r.getMessage() and kernel in r.getMessage()
        for r in caplog.records
    )


def test_the_writer_is_the_packages_own(tmp_path):
    """The checkpoints these tests read are compressed-tensors' (its config and tensor names), not lmiserve's."""
    folder = write_compressed(quantizable_llama(41), tmp_path / "w", "w4a16-asym", 32)
    config = config_of(folder)["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["version"] and config["ignore"] == ["lm_head"]
    names = {key.rpartition(".")[2] for key in load_file(str(folder / "model.safetensors"))}
    assert {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"} <= names


# --- 8-bit integer weights (W8A8, W8A16) ----------------------------------------------------------------------


@pytest.mark.parametrize(("scheme", "fmt", "group"), [("W8A8", "int-quantized", -1), ("W8A16", "pack-quantized", 128)])
def test_eight_bit_integer_schemes_are_read_and_named_by_compressed_tensors_alone(tmp_path, scheme, fmt, group):
    folder = with_config(tmp_path, scheme, preset(scheme, fmt))
    spec = checkpoint_quantization(folder, "compressed-tensors")
    assert spec is not None and spec.method == "int8" and spec.bits == 8 and spec.group_size == group
    assert spec.packed == (fmt == "pack-quantized") and checkpoint_quantization(folder, None) == spec
    with pytest.raises(ModelLoadError, match=r"is a int8 checkpoint \(compressed-tensors\): set quantize=compressed-t"):
        checkpoint_quantization(folder, "gptq")


def test_eight_bit_weights_with_float_activations_are_refused(tmp_path):
    config = preset("W8A8", "int-quantized")
    config["config_groups"]["group_0"]["input_activations"]["type"] = "float"
    with pytest.raises(ModelLoadError, match="8-bit integer weights with float activations are not supported"):
        checkpoint_quantization(with_config(tmp_path, "w8-fp8", config), None)


def test_w8a8_runs_torchs_int8_kernel_on_a_cpu_computing_in_bf16(tmp_path):
    """W8A8's symmetric int8 weights by channel are `Int8Linear`'s own form: in bf16 on a CPU each linear keeps its
    int8 codes and scales (the weight it multiplies is the package's de-quantization, exactly); in fp32 they keep them
    on the q8 kernel (`cpu_codes.q8_layer`: each channel's scale over its groups of 32), exactly too."""
    from helpers.compressed_ints import decompressed
    from lmiserve.engine.model.quantize import Int8Linear, int8_available

    folder = write_checkpoint(quantizable_llama(41), tmp_path / "w8a8", "w8a8", 0)
    flat = load_file(str(folder / "model.safetensors"))
    loaded = load_causal_lm(folder, device="cpu", dtype="bf16")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int8Linear) == int8_available(), type(q_proj)
    tensors = {k.rpartition(".")[2]: v for k, v in flat.items() if k.startswith("model.layers.0.self_attn.q_proj.")}
    want = decompressed("w8a8", 0, tensors)
    got = q_proj.dequantized() if isinstance(q_proj, Int8Linear) else q_proj.weight.float()
    assert torch.equal(got, want) if isinstance(q_proj, Int8Linear) else torch.allclose(got, want, rtol=1e-2)
    fp32 = load_causal_lm(folder, device="cpu").model.model.layers[0].self_attn.q_proj
    assert type(fp32) is (Q8Linear if int4_available() else torch.nn.Linear)
    assert torch.equal(fp32.dequantized() if isinstance(fp32, Q8Linear) else fp32.weight, want)
