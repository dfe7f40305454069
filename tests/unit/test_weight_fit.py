"""A 4-bit (AWQ/GPTQ) checkpoint on CUDA keeps its codes on the Triton kernel where its weights de-quantized would not
fit the GPU (a 70B AWQ model on one 80 GB GPU: 140 GB in bf16), and is de-quantized to bf16 where they fit (faster
products, until the kernel is measured on a GPU); ``LMISERVE_USE_TRITON_INT4`` forces either way
(engine/model/weight_fit.py, int4_triton.py `codes_kept`, models/quantized_load.py). An fp8 checkpoint on a GPU
without fp8 products (A100, A10G) keeps its fp8 weights on `fp8_gemv`'s widening kernel by the same rule
(``LMISERVE_USE_TRITON_FP8``), and compressed-tensors' 8-bit codes on any GPU on it too (``LMISERVE_USE_TRITON_INT8``,
engine/model/int8_weights.py). The GPU's free memory (and for fp8 its compute capability) is the one figure given
here: the rest is the loader's own reading of the checkpoint's model."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from helpers.quantizable import quantizable_llama, write_checkpoint
from lmiserve.engine import fp8_devices
from lmiserve.engine.model import fp8_gemv, int4_triton, int8_weights, kernel_choice
from lmiserve.engine.model.quant_formats import Fp8Linear
from lmiserve.engine.model.quantize import Q8Linear, int4_available
from lmiserve.engine.model.shard_checkpoint import load_shard_weights
from lmiserve.engine.model.sharding import shard_model
from lmiserve.models.load import load_causal_lm, load_model_shell
from lmiserve.models.quantized_load import checkpoint_quantization, load_quantized

GB = 10**9


@pytest.mark.parametrize(
    ("forced", "dequantized", "free", "kept"),
    [
        (None, 16 * GB, 80 * GB, False),  # an 8B model on an H100: bf16 fits, with room for the KV cache
        (None, 140 * GB, 80 * GB, True),  # a 70B model: it does not
        (None, 16 * GB, 24 * GB, True),  # an 8B model on an A10G: bf16 would leave 8 GB of 24
        (None, 40 * GB, 80 * GB, False),  # half: still de-quantized
        (True, 16 * GB, 80 * GB, True),  # LMISERVE_USE_TRITON_INT4=1
        (False, 140 * GB, 80 * GB, False),  # =0
    ],
)
def test_the_codes_stay_where_de_quantized_weights_would_not_fit(monkeypatch, forced, dequantized, free, kept):
    monkeypatch.setattr(int4_triton, "USE_ON_CUDA", forced)
    assert int4_triton.codes_kept(dequantized, free) is kept


def test_the_environment_forces_either_way(monkeypatch):
    """`int4_triton.USE_ON_CUDA` is `kernel_choice.switch` of the variable (read at import; the module is not
    reloaded here: its classes are held by the loaders); a value it does not know stops the start."""
    assert 'USE_ON_CUDA = kernel_choice.switch("LMISERVE_USE_TRITON_INT4")' in Path(int4_triton.__file__).read_text()
    for value, want in (("1", True), ("0", False), ("", None), ("auto", None)):
        monkeypatch.setenv("LMISERVE_USE_TRITON_INT4", value)
        assert kernel_choice.switch("LMISERVE_USE_TRITON_INT4") is want
    monkeypatch.setenv("LMISERVE_USE_TRITON_INT4", "yes")
    with pytest.raises(ValueError, match="LMISERVE_USE_TRITON_INT4='yes': expected 1 \\(on\\), 0 \\(off\\)"):
        kernel_choice.switch("LMISERVE_USE_TRITON_INT4")


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(quantizable_llama(39), tmp_path_factory.mktemp("awq") / "awq", "awq", 128, False)


def test_the_loader_weighs_the_model_de_quantized_against_the_gpus_free_memory(awq_dir, monkeypatch, caplog):
    """The model on the meta device (as `load_quantized` builds it) in bf16: every parameter's bytes, the 4-bit
    linears' as bf16; against half the free memory; on a CPU the question is not asked."""
    config = AutoConfig.from_pretrained(awq_dir)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = 2 * sum(p.numel() for p in model.parameters())
    free: list[int] = []
    monkeypatch.setattr(int4_triton, "USE_ON_CUDA", None)
    monkeypatch.setattr(int4_triton, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free[-1], 2 * free[-1]))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger=int4_triton.__name__):
        free.append(2 * total)  # de-quantized, exactly half: de-quantized
        assert int4_triton.codes_kept_for(model, cuda, "awq") is False
        free.append(2 * total - 2)  # a little over half
        assert int4_triton.codes_kept_for(model, cuda, "awq") is True
        monkeypatch.setattr(int4_triton, "USE_ON_CUDA", False)
        assert int4_triton.codes_kept_for(model, cuda, "awq") is False
    lines = [r.getMessage() for r in caplog.records]
    size = f"{total / GB:.1f} GB de-quantized to bfloat16"
    assert lines[0].startswith(f"awq: de-quantized at load ({size}, {2 * total / GB:.1f} GB free on the GPU: ")
    assert (
        lines[1].startswith("awq: 4-bit codes on the Triton kernel (")
        and "quantized where that is over 50%" in lines[1]
    )
    assert lines[2] == "awq: de-quantized at load (forced by LMISERVE_USE_TRITON_INT4)"
    assert int4_triton.codes_kept_for(model, torch.device("cpu"), "awq") is None


def one_process_and_a_rank(path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The quantized checkpoint in `path` loaded on the CPU by one process, and by rank 1 of 2 (its shell)."""
    spec = checkpoint_quantization(path, None)
    assert spec is not None
    whole, _ = load_quantized(path, spec, torch.float32, torch.device("cpu"))
    shell = load_model_shell(path, dtype="fp32", device="cpu").model
    shard_model(shell, 1, 2, None)
    load_shard_weights(shell, path, spec, torch.device("cpu"))
    return whole, shell


def test_one_process_and_each_tensor_parallel_rank_weigh_what_they_load(awq_dir, monkeypatch):
    """The loader asks once, of the whole model; a tensor-parallel rank asks of its shell (its cut of the layers)."""
    asked: list[tuple[str, int]] = []

    def spy(model: torch.nn.Module, device: torch.device, name: str) -> bool | None:
        asked.append((name, sum(p.numel() for p in model.parameters())))
        return None  # (a CPU's answer: the question is not asked there)

    monkeypatch.setattr(int4_triton, "codes_kept_for", spy)
    one_process_and_a_rank(awq_dir)
    (one, whole_size), (rank, rank_size) = asked
    assert (one, rank) == ("awq", "rank 1")
    assert whole_size == sum(p.numel() for p in quantizable_llama(39).parameters()) and rank_size < whole_size


@pytest.mark.parametrize("fmt", ["awq", "gptq-int8"])
def test_a_mixture_of_experts_coded_experts_follow_the_linears_decision(tmp_path, monkeypatch, fmt):
    """A quantized mixture of experts' 4-bit or 8-bit experts keep their codes by the rule of its linears: the loader
    asks once (one process, and each rank), and the experts follow that answer (here a GPU's "no": they are
    de-quantized, where their own module would otherwise be asked again and log the decision a second time)."""
    from helpers.kept_experts import moe

    kernels = {"awq": (int4_triton, "codes_kept_for"), "gptq-int8": (int8_weights, "weights_kept_for")}
    asked: list[str] = []

    def spy(model: torch.nn.Module, device: torch.device, name: str) -> bool:
        asked.append(name)
        return False  # (a GPU's answer where bf16 fits)

    monkeypatch.setattr(*kernels[fmt], spy)
    write_checkpoint(moe("qwen3_moe"), tmp_path, fmt, 32)
    loads = one_process_and_a_rank(tmp_path)
    assert asked == [tmp_path.name, "rank 1"]
    for loaded in loads:
        experts = loaded.model.layers[0].mlp.experts
        assert not hasattr(experts, "kept_kernel") and experts.down_proj.dtype == torch.float32


@pytest.fixture
def meta_model(awq_dir: Path) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(awq_dir)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


# what keeps its weights quantized, by kernel: (module, its switch, what the log says kept weights run on)
KEEPERS = {
    "fp8": (fp8_gemv, "LMISERVE_USE_TRITON_FP8", "fp8 weights on the widening Triton kernel"),
    "int8": (int8_weights, "LMISERVE_USE_TRITON_INT8", "int8 codes on the Triton kernel"),
}


@pytest.mark.parametrize(
    ("kind", "capability", "forced", "free_share", "kept"),
    [
        ("fp8", (8, 6), None, 1.5, True),  # an A10G: bf16 would take two thirds of the free memory
        ("fp8", (8, 0), None, 3.0, False),  # an A100 with room: bf16 (measured products)
        ("fp8", (8, 0), True, 3.0, True),  # LMISERVE_USE_TRITON_FP8=1
        ("fp8", (8, 6), False, 1.5, False),  # =0
        ("fp8", (8, 9), None, 1.5, None),  # an L4: fp8 products of its own (Fp8Linear always)
        ("fp8", (9, 0), None, 1.5, None),  # an H100
        ("fp8", (7, 5), None, 1.5, None),  # a T4: de-quantized (no bf16, not served by the kernel)
        ("int8", (9, 0), None, 1.5, True),  # W8A8 on an H100 where bf16 would take two thirds of the free memory
        ("int8", (8, 6), None, 3.0, False),  # an A10G with room: bf16 (measured products)
        ("int8", (9, 0), True, 3.0, True),  # LMISERVE_USE_TRITON_INT8=1
        ("int8", (8, 0), False, 1.5, False),  # =0
        ("int8", (7, 5), None, 1.5, None),  # a T4: de-quantized (not served by the kernel)
    ],
)
def test_quantized_weights_stay_on_their_kernel_where_bf16_would_not_fit(
    meta_model, monkeypatch, caplog, kind, capability, forced, free_share, kept
):
    """fp8 weights on a GPU without fp8 products (`fp8_gemv.weights_kept_for`), compressed-tensors' 8-bit codes on
    any GPU of compute capability 8.0+ (`int8_weights.weights_kept_for`)."""
    module, switch, kept_as = KEEPERS[kind]
    total = 2 * sum(p.numel() for p in meta_model.parameters())
    monkeypatch.setattr(fp8_devices, "_native", {})
    monkeypatch.setattr(module, "USE_ON_CUDA", forced)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(free_share * total), 4 * total))
    with caplog.at_level(logging.INFO, logger=module.__name__):
        assert module.weights_kept_for(meta_model, torch.device("cuda", 0), kind) is kept
    if kept is not None:
        said = f"{kind}: {kept_as} (" if kept else f"{kind}: de-quantized at load ("
        assert caplog.records[-1].getMessage().startswith(said)
        assert (f"forced by {switch}" in caplog.text) is (forced is not None)
    assert module.weights_kept_for(meta_model, torch.device("cpu"), kind) is None


@pytest.mark.parametrize("kind", list(KEEPERS))
def test_the_switches_are_read_from_the_environment(kind: str) -> None:
    module, switch, _ = KEEPERS[kind]
    assert f'USE_ON_CUDA = kernel_choice.switch("{switch}")' in Path(module.__file__).read_text()


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(quantizable_llama(39), tmp_path_factory.mktemp("fp8") / "fp8", "fp8-channel")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(quantizable_llama(39), tmp_path_factory.mktemp("float") / "float", "float")


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(quantizable_llama(39), tmp_path_factory.mktemp("fp8-block") / "fp8-block", "fp8-block", 64)


@pytest.mark.parametrize("answer", [True, None], ids=["kept", "not-asked"])
def test_every_fp8_load_asks_and_keeps_fp8_weights_where_told(fp8_dir, float_dir, block_dir, monkeypatch, answer):
    """An fp8 checkpoint in one process, a tensor-parallel rank's cut of it, ``quantize=fp8`` of a float model and
    a block-wise fp8 checkpoint (asking for its blocks) each ask once of what they load; where the answer is to keep
    (an A10G; for blocks any GPU), every linear of the layers is an `Fp8Linear` (here on a CPU, where the answer is
    never asked, none is: they are the CPU's own `Q8Linear` of fp8 codes, `cpu_codes.fp8_layer`)."""
    asked: list[tuple[str, bool]] = []

    def spy(model: torch.nn.Module, device: torch.device, name: str, blocks: bool = False) -> bool | None:
        asked.append((name, blocks))
        return answer

    monkeypatch.setattr(fp8_gemv, "weights_kept_for", spy)
    whole, shell = one_process_and_a_rank(fp8_dir)
    dynamic = load_causal_lm(float_dir, device="cpu", quantize="fp8").model
    blocks = load_causal_lm(block_dir, device="cpu").model
    assert asked == [("fp8", False), ("rank 1", False), ("quantize=fp8", False), ("fp8-block", True)]
    on_cpu = Q8Linear if int4_available() else torch.nn.Linear
    for model in (whole, shell, dynamic, blocks):
        layer = model.model.layers[0]
        for linear in (layer.mlp.down_proj, layer.self_attn.q_proj):
            assert isinstance(linear, Fp8Linear if answer else on_cpu), type(linear)
            assert linear.weight.dtype == (torch.float8_e4m3fn if answer or on_cpu is Q8Linear else torch.float32)
