"""NVIDIA Model Optimizer's fp8 checkpoints (``quant_method: modelopt``, as NVIDIA publishes its ``-FP8`` models),
written by ModelOpt's own export from a tiny random Llama (`helpers.modelopt_checkpoints`): what the config names,
in ``config.json`` or in the older ``hf_quant_config.json`` alone; ModelOpt's other algorithms refused in one line;
the weights are the float model's within fp8's rounding (ModelOpt's ``weight_scale`` multiplies); the KV cache
scales it writes serve ``kv_cache_dtype=fp8``. Each linear's exact reference and the engine's greedy tokens:
test_quantized_checkpoints.py (``modelopt-*`` cases); tensor-parallel ranks: test_tensor_parallel_quantized.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.float_weights import weight_of
from helpers.modelopt_checkpoints import legacy_copy, write_modelopt
from helpers.quantizable import quantizable_llama
from helpers.tiny_model import build_tiny_tokenizer
from lmiserve.config import load_settings
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.factory import kv_format_of
from lmiserve.engine.model.quant_formats import QuantSpec
from lmiserve.engine.model.quantize import Q8Linear, int4_available
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.load import load_causal_lm
from lmiserve.models.quantized_load import checkpoint_quantization

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("modelopt-fp8", "modelopt-fp8-channel", "modelopt-fp8-block")
SEED = 7


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modelopt")
    model = quantizable_llama(SEED)
    made = {fmt: write_modelopt(model, root / fmt, fmt, kv_cache=fmt == "modelopt-fp8") for fmt in FORMATS}
    for folder in made.values():
        build_tiny_tokenizer().save_pretrained(folder)
    made.update({f"{fmt}-legacy": legacy_copy(made[fmt], root / f"{fmt}-legacy") for fmt in FORMATS})
    return made


@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_modelopts_fp8_algorithms_are_read_as_fp8_checkpoints(folders, fmt, legacy):
    folder = folders[f"{fmt}-legacy" if legacy else fmt]
    config = json.loads((folder / "config.json").read_text())
    assert ("quantization_config" in config) != legacy and (folder / "hf_quant_config.json").is_file()
    want = QuantSpec("fp8", "modelopt", blocks=(128, 128) if fmt == "modelopt-fp8-block" else None)
    for quantize in (None, "fp8", "modelopt", "ModelOpt"):
        assert checkpoint_quantization(folder, quantize) == want, quantize
    with pytest.raises(
        ModelLoadError, match=r"quantize=awq, but .* is a fp8 checkpoint \(modelopt\): set quantize=fp8"
    ):
        checkpoint_quantization(folder, "awq")


@pytest.mark.parametrize(
    "algo", ["NVFP4", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL", "MXFP8", "MIXED_PRECISION", "W4A8_AWQ", None]
)
@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
def test_modelopts_other_algorithms_are_refused_in_one_line(tmp_path, algo, legacy):
    section = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    config: dict = {"model_type": "llama"}
    if legacy:
        (tmp_path / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": section})
        )
    else:
        config["quantization_config"] = {**section, "quant_method": "modelopt"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        checkpoint_quantization(tmp_path, None)
    message = str(error.value)
    assert message == (
        f"ModelOpt quant_algo {algo!r} is not supported: lmiserve reads ModelOpt's FP8, FP8_PER_CHANNEL_PER_TOKEN "
        "and FP8_PB_WO"
    )


def test_vllms_modelopt_fp4_word_is_refused_by_its_algorithm(tmp_path):
    config = {"quantization_config": {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="ModelOpt quant_algo 'NVFP4' is not supported"):
        checkpoint_quantization(tmp_path, None)


def test_another_producers_hf_quant_config_is_not_read_as_modelopts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    other = {"producer": {"name": "someone-else"}, "quantization": {"quant_algo": "FP8"}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(other))
    assert checkpoint_quantization(tmp_path, None) is None


def test_quantize_modelopt_names_a_checkpoints_format(tmp_path, folders):
    """`quantize=modelopt` (vLLM's `quantization` word) on a float checkpoint or a dummy load is refused in one line;
    the settings take it."""
    float_dir = tmp_path / "float"
    quantizable_llama(SEED).save_pretrained(float_dir)
    with pytest.raises(ModelLoadError, match="quantize=modelopt: float is not a MODELOPT checkpoint"):
        checkpoint_quantization(float_dir, "modelopt")
    with pytest.raises(ModelLoadError, match="quantize=modelopt names a checkpoint's format"):
        checkpoint_quantization(float_dir, "modelopt", "dummy")
    assert load_settings({"quantization": "modelopt"}, environ={}).quantize == "modelopt"
    assert load_settings(environ={"OPTION_QUANTIZE": "modelopt"}).quantize == "modelopt"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_weights_are_the_float_models_within_fp8s_rounding(folders, fmt):
    """ModelOpt's ``weight_scale`` multiplies the fp8 values (a divisor, as transformers' ``weight_scale_inv`` reads,
    would be far off): each de-quantized linear is the float model's within half an fp8 step of its largest value
    (a scale a tensor; finer where the scale is a row's or a block's), and not equal to it. The legacy config reads
    the same weights."""
    float_model = quantizable_llama(SEED)
    loaded = load_causal_lm(folders[fmt], device="cpu").model
    legacy = load_causal_lm(folders[f"{fmt}-legacy"], device="cpu").model
    for name, module in loaded.named_modules():
        if name.rpartition(".")[2] not in LINEARS:
            continue
        assert isinstance(module, Q8Linear) or not int4_available(), name  # a CPU's: fp8 on the q8 kernel (cpu_codes)
        got, want = weight_of(module), float_model.get_submodule(name).weight.detach()
        error = (got - want).abs().max().item()
        assert 0 < error <= want.abs().max().item() / 16, (name, error)
        assert torch.equal(got, weight_of(legacy.get_submodule(name))), name
    assert torch.equal(loaded.lm_head.weight, float_model.lm_head.weight)  # (excluded: stored float)


def test_its_kv_cache_scales_serve_an_fp8_kv_cache(folders):
    """The KV scales ModelOpt's FP8 KV config writes (``k_proj.k_scale``, ``v_proj.v_scale``, calibrated) are each
    layer's scales of an fp8 pool; `auto` reads none."""
    folder = folders["modelopt-fp8"]
    stored = load_file(str(folder / "model.safetensors"))
    at = "model.layers.{}.self_attn.{}_proj.{}_scale"
    want = [(stored[at.format(i, "k", "k")].item(), stored[at.format(i, "v", "v")].item()) for i in range(2)]
    assert all(0 < k < 1 and 0 < v < 1 for k, v in want)  # (calibrated: not 1.0)
    loaded = load_causal_lm(folder, device="cpu")
    assert kv_format_of(loaded, EngineConfig(kv_cache_dtype="fp8")).layer_scales(2) == want
    assert kv_format_of(loaded, EngineConfig()).layer_scales(2) == [(1.0, 1.0)] * 2
